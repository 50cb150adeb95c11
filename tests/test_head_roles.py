"""Hybrid heads: role maps and their checks (sgl_sparsekv/head_roles.py)."""

import json

import numpy as np
import pytest
import torch

from sgl_sparsekv import head_roles
from sgl_sparsekv.config import ConfigError, SparseKVConfig
from sgl_sparsekv.patches.checks import check_model

L, FIRST, H = 8, 2, 3


def test_staggered_roles_bound_every_chain():
    roles = np.array(head_roles.staggered_roles(L, H, FIRST, 8))
    period = round((L - FIRST) * H / 8)
    for h in range(H):
        at = np.flatnonzero(roles[:, h])
        assert at[0] == FIRST and np.diff(at).max() <= period


SHAPES = {"qwen2.5-coder-0.5b": (24, 2), "smollm2": (30, 3)}


@pytest.mark.parametrize("name", sorted(p.stem for p in head_roles.SHIPPED.glob("*.json")))
def test_shipped_maps_fit_their_models(name):
    data = head_roles.load_map(name)
    layers, kv = SHAPES[data["model"]]
    roles = head_roles.resolve(name, layers, kv, 2)
    assert len(roles) == layers - 2 and roles[0] == list(range(kv))
    assert sum(map(len, roles)) == data["retrieval_heads"] < data["of"] == (layers - 2) * kv
    cfg = SparseKVConfig.from_method("lychee", {"head_roles": name})
    other = next(m for m in SHAPES if m != data["model"])
    hf = type("HF", (), {"num_hidden_layers": SHAPES[other][0], "num_key_value_heads": SHAPES[other][1]})()
    with pytest.raises(ConfigError, match=f"head_roles: '{name}' \\(made for {data['model']}: {layers} layers"):
        check_model(hf, cfg)


def test_staggered_resolves_for_any_model():
    roles = head_roles.resolve("staggered-0.25", 32, 8, 2)
    assert roles[0] == list(range(8)) and len(roles) == 30
    assert abs(sum(map(len, roles)) - 0.25 * 240) <= 8
    assert head_roles.resolve("all-retrieval", 32, 8, 2) is None


@pytest.mark.parametrize("value,msg", [
    ("staggered-0", "share must be in"), ("staggered-1.5", "share must be in"),
    ("no-such-map", "is not 'all-retrieval'"), ("{layers}", "is not 'all-retrieval'"),
    ('{"layers": ["dense", "RX"]}', "one R/S letter"), ('{"layers": ["dense", "RS"]}', "must be all R"),
    ('{"layers": ["RR", "dense"]}', "dense layers must come first"), ('{"layers": ["dense", "RR", "R"]}', "one R/S"),
    ("not json", "not valid JSON"), ('{"roles": []}', "needs a 'layers' list")])
def test_bad_head_roles_are_one_line_errors(tmp_path, value, msg):
    if value.startswith("{") and value != "{layers}" or value == "not json":
        (tmp_path / "m.json").write_text(value)
        value = str(tmp_path / "m.json")
    with pytest.raises(ConfigError, match=msg) as e:
        SparseKVConfig.from_method("lychee", {"head_roles": value})
    assert "\n" not in str(e.value)


def test_head_roles_is_lychee_only():
    with pytest.raises(ConfigError, match="applies to --sparse-kv lychee"):
        SparseKVConfig.from_method("quest", {"head_roles": "staggered-0.5"})


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_fidelity_hybrid_methods_have_a_map_for_each_model(model):
    from bench.fidelity import METHODS

    hybrid = {n: extra["head_roles"].format(model=model) for n, (_, extra) in METHODS.items() if "head_roles" in extra}
    assert len(hybrid) == 4
    layers, kv = SHAPES[model]
    for spec in hybrid.values():
        SparseKVConfig.from_method("lychee", {"head_roles": spec})
        roles = head_roles.resolve(spec, layers, kv, 2)
        assert len(roles) == layers - 2 and 0 < sum(map(len, roles)) < (layers - 2) * kv


PLANTED = (1500, 2, 2, 16, 700)   # tokens, KV heads, query heads per KV head, head dim, the planted key's position


def planted_layers(seed: int):
    """(boundary table, token ids, three layers of random (q, k, v)) where query head 3 (KV head 1) at the last
    position reads only the key planted at ``PLANTED[-1]``."""
    from sgl_sparsekv.chunking import BoundaryTable

    T, H, G, d, planted = PLANTED
    g = torch.Generator().manual_seed(seed)
    table = BoundaryTable.from_texts(["a", " b", ".", " c", "\n"])
    ids = np.array(torch.randint(0, 5, (T,), generator=g))
    layers = []
    for _ in range(3):
        q, k, v = (torch.randn(n, T, d, generator=g) for n in (H * G, H, H))
        k[1, planted] = 40 * q[3, T - 1] / q[3, T - 1].norm()
        layers.append((q, k, v))
    return table, ids, layers


def test_serving_bench_qwen_shape_takes_the_shipped_qwen_maps(tmp_path):
    """bench.gpu_serving --shape qwen2.5-coder-0.5b rewrites mkmodel's Llama config into Qwen2.5-Coder-0.5B's shape:
    the server's startup check accepts every lychee-qwen-* variant's role map on it (a map that did not fit would
    fail only on the GPU machine), and rejects them on the Llama shape."""
    from transformers import AutoConfig

    from bench.gpu_serving import VARIANTS, write_shape

    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 128256, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1,
             "eos_token_id": 2, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    before = AutoConfig.from_pretrained(tmp_path)
    assert "Qwen2.5-Coder-0.5B" in write_shape(str(tmp_path), "qwen2.5-coder-0.5b")
    hf = AutoConfig.from_pretrained(tmp_path)
    assert (hf.model_type, hf.num_hidden_layers, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads) == \
        ("qwen2", 24, 2, 64)
    qwen = [name for name in VARIANTS if name.startswith("lychee-qwen-")]
    assert len(qwen) == 3
    for name in qwen:
        cfg = SparseKVConfig.from_method("lychee", VARIANTS[name])
        check_model(hf, cfg)
        with pytest.raises(ConfigError, match="does not fit"):
            check_model(before, cfg)
