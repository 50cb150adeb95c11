"""Every Triton kernel the CPU tests launch in the interpreter, compiled for the GPU too (sm_90, with the ptxas the
Triton wheel ships; no GPU needed).

The interpreter runs a kernel's Python, so it misses what only the compiler sees: a type or layout it cannot lower,
an op it lacks, registers spilled to local memory. ``record`` (installed by conftest.py) notes each launch's
signature as Triton's JIT would specialize it (argument types, constexprs, 16-byte alignment of pointers and
ints divisible by 16); ``python tests/kernel_launches.py LAUNCHES.json`` (run without TRITON_INTERPRET, so the
kernels import as JIT functions) compiles each distinct one and prints, per launch, its registers and the bytes it
spills (``tests/test_kernels_compile.py`` asserts on them).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "i8", "uint8": "u8", "int16": "i16",
          "int32": "i32", "int64": "i64", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
          "float8_e5m2": "fp8e5"}
OPTIONS = ("num_warps", "num_stages")
LAUNCHES: dict[str, dict] = {}
ELSEWHERE = False   # set by conftest.py while a test of the other half of a `pytest -n 2` run runs here


def _constexpr(p: inspect.Parameter) -> bool:
    return "constexpr" in str(p.annotation)


def bound_args(ifn, args, kwargs) -> dict:
    """{parameter name: value} of a launch of ``ifn`` (a ``triton.runtime.interpreter.InterpretedFunction``)."""
    params = inspect.signature(ifn.fn).parameters
    return dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}


def record(ifn, args, kwargs) -> None:
    """Note one interpreted launch of ``ifn``."""
    if ELSEWHERE:
        raise RuntimeError(f"{ifn.fn.__name__} launched outside the kernels half (tests/conftest.py: half), where "
                           "the sm_90 compile check would not see it")
    import torch
    import triton.language as tl

    fn = ifn.fn
    params = inspect.signature(fn).parameters
    bound = bound_args(ifn, args, kwargs)
    plain = set(ifn.kwargs.get("do_not_specialize") or ())
    unaligned = set(ifn.kwargs.get("do_not_specialize_on_alignment") or ())
    sig, const, div = {}, {}, []
    for i, (name, p) in enumerate(params.items()):
        v = bound.get(name, p.default)
        if _constexpr(p) or v is None:
            const[name] = {"tl_dtype": str(v)} if isinstance(v, tl.dtype) else v
        elif torch.is_tensor(v):
            sig[name] = "*" + DTYPES[str(v.dtype).removeprefix("torch.")]
            div += [i] if v.data_ptr() % 16 == 0 and name not in unaligned else []
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and name not in plain:   # Triton specializes an int 1 as a constant
                const[name] = 1
                continue
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            div += [i] if v % 16 == 0 and name not in plain else []
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    launch = {"module": fn.__module__, "kernel": fn.__name__, "signature": sig, "constexprs": const,
              "divisible_16": div, "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}
    LAUNCHES.setdefault(json.dumps(launch, sort_keys=True), launch)


def install() -> None:
    """Record every interpreted launch from now on."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "recording", False):
        return

    def recording_run(self, *args, grid, warmup, **kwargs):
        record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run.recording = True
    InterpretedFunction.run = recording_run


def compile_sm90(launch: dict) -> dict:
    """One launch compiled for sm_90: {"registers", "spill_bytes"} from the cubin's resource usage."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    names = fn.arg_names
    # IEEE: fp32 dot operands, which kernels/select.py takes only in the interpreter (its bf16 dots go wrong there)
    const = {n: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v for n, v in launch["constexprs"].items()}
    const |= {"IEEE": False} if "IEEE" in const else {}
    signature = {n: ("constexpr" if n in const else launch["signature"][n]) for n in names}
    src = ASTSource(fn, signature, {(names.index(n),): v for n, v in const.items()},
                    {(i,): [["tt.divisibility", 16]] for i in launch["divisible_16"]})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump", "--dump-resource-usage",
                                f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(x.split(":") for line in usage.splitlines() if "REG:" in line for x in line.split() if ":" in x)
    return {"registers": int(fields["REG"]), "spill_bytes": int(fields["STACK"]) + int(fields["LOCAL"])}


def distinct(launches: list[dict]) -> list[dict]:
    """One launch per kernel, constexprs, options and argument types: the one with the most aligned arguments."""
    best = {}
    for launch in launches:
        key = json.dumps([launch[k] for k in ("module", "kernel", "signature", "constexprs", "options")],
                         sort_keys=True)
        if key not in best or len(launch["divisible_16"]) > len(best[key]["divisible_16"]):
            best[key] = launch
    return list(best.values())


def checked(launch: dict) -> dict:
    try:
        return dict(launch, **compile_sm90(launch))
    except Exception as e:   # reported per launch; the test names them
        return dict(launch, error=f"{type(e).__name__}: {str(e)[:2000]}")


def main(path: str) -> None:
    from concurrent.futures import ProcessPoolExecutor

    with open(path) as f:
        launches = distinct(json.load(f))
    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        json.dump(list(pool.map(checked, launches)), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
