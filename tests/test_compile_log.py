"""sgl_sparsekv.compile_log: Triton's JIT hooks, called through Triton's own ``JITFunction._call_hook`` as a compile
calls them (a CPU has no Triton backend to compile for; the GPU server runs them for real)."""

import json
import time
import types

import pytest


def _fine_bounds_kernel(X, n, BLOCK):
    pass


def _emit_kernel(X, n, BLOCK):
    pass


def call(hook, fn, block: int):
    """``hook`` as Triton calls it for a compile of ``fn`` (a plain function standing for a kernel) at ``BLOCK``."""
    from triton.runtime.jit import JITFunction

    options = types.SimpleNamespace(num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True,
                                    launch_cooperative_grid=False, extern_libs=None)
    signature = {"X": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    key = (tuple(signature.values()), ["*bf16", "i32", block])
    return JITFunction(fn)._call_hook(hook, key, signature, 0, {("BLOCK",): block}, options, [{}], False)


@pytest.fixture
def hooks(monkeypatch):
    """Triton's two hooks as a caller set them before (recording their calls), and no compile log installed."""
    from triton import knobs

    from sgl_sparsekv import compile_log

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("cache", kw["fn"].name)))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("post", kw["fn"].name)))
    monkeypatch.setattr(compile_log, "_installed", None)
    return knobs.runtime, seen


def test_each_compile_is_logged_with_its_time_and_specialization(hooks, monkeypatch, tmp_path):
    from sgl_sparsekv import compile_log

    rt, seen = hooks
    path = tmp_path / "compiles.jsonl"
    monkeypatch.delenv(compile_log.ENV, raising=False)
    assert not compile_log.install_from_env()       # unset: Triton's hooks stay as they were
    assert rt.jit_post_compile_hook.__name__ == "<lambda>"
    monkeypatch.setenv(compile_log.ENV, str(path))
    assert compile_log.install_from_env() and not compile_log.install_from_env()   # once per process
    # a scripted clock: the compiles take 0.25 s, 0.002 s and 0 s
    clock = iter([10.0, 10.25, 20.0, 20.002, 30.0, 30.0])
    monkeypatch.setattr(compile_log, "time", types.SimpleNamespace(perf_counter=lambda: next(clock), time=time.time))
    for fn, block in ((_fine_bounds_kernel, 16), (_emit_kernel, 16), (_fine_bounds_kernel, 128)):
        call(rt.jit_cache_hook, fn, block)
        call(rt.jit_post_compile_hook, fn, block)
    assert seen == [(w, n) for n in ("_fine_bounds_kernel", "_emit_kernel", "_fine_bounds_kernel")
                    for w in ("cache", "post")]    # the hooks set before still run
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kernel"] for r in rows] == [f"{__name__}._fine_bounds_kernel", f"{__name__}._emit_kernel",
                                           f"{__name__}._fine_bounds_kernel"]
    assert [r["seconds"] for r in rows] == [0.25, 0.002, 0.0]
    assert rows[0]["at"] <= rows[1]["at"] <= round(time.time(), 3)   # "at" is rounded to the millisecond
    assert json.loads(rows[2]["specialization"])["key"][1] == ["*bf16", "i32", 128]
    summary = compile_log.summary(str(path))
    assert [(s["kernel"].rsplit(".", 1)[1], s["compiles"]) for s in summary] == [("_fine_bounds_kernel", 2),
                                                                                ("_emit_kernel", 1)]


def test_a_cache_hook_set_before_still_skips_the_compile(hooks, tmp_path):
    from sgl_sparsekv import compile_log

    rt, _ = hooks
    rt.jit_cache_hook = lambda **kw: True   # "already handled": Triton then neither compiles nor calls the post hook
    compile_log.install(str(tmp_path / "c.jsonl"))
    assert call(rt.jit_cache_hook, _emit_kernel, 16) is True
