"""Memory bounds for Triton kernels run in the interpreter: every load and store a launch makes (where its mask is
true) must lie inside the storage of one of the launch's tensor arguments.

On the GPU an access past an allocation reads or corrupts whatever lies there, or stops the process with an illegal
address; the interpreter reads and writes raw host addresses and checks nothing, so such a kernel passes every CPU
test (the crash of issue #6 was one). ``install`` (conftest.py, under TRITON_INTERPRET=1) makes each interpreted
access raise ``OutOfBounds``, naming the kernel, the argument nearest to the address and by how many bytes it missed.
"""

from __future__ import annotations

import bisect
import gc

import numpy as np

from kernel_launches import bound_args


class OutOfBounds(IndexError):
    pass


class _Launch:
    """The storages a launch may touch: sorted (start, end, argument name)."""

    def __init__(self, kernel: str, spans: list[tuple[int, int, str]]):
        self.kernel = kernel
        self.spans = sorted(spans)
        self.starts = [s for s, _, _ in self.spans]

    def check(self, ptrs: np.ndarray, mask: np.ndarray, itemsize: int, op: str) -> None:
        addr = ptrs[np.broadcast_to(mask, ptrs.shape)] if mask is not None else ptrs.ravel()
        if addr.size == 0:
            return
        lo, hi = int(addr.min()), int(addr.max()) + itemsize
        i = bisect.bisect_right(self.starts, lo) - 1
        if i >= 0 and hi <= self.spans[i][1]:
            return   # one storage holds them all (a pointer tensor has one base argument)
        for a in np.unique(addr).tolist():   # the exact check, to name the first address outside
            j = bisect.bisect_right(self.starts, a) - 1
            if j < 0 or a + itemsize > self.spans[j][1]:
                self._fail(a, itemsize, op)

    def _fail(self, a: int, itemsize: int, op: str) -> None:
        def gap(span):
            start, end, _ = span
            return start - a if a < start else a + itemsize - end
        start, end, name = min(self.spans, key=gap)
        where = f"{start - a} bytes before" if a < start else f"{a + itemsize - end} bytes past the end of"
        raise OutOfBounds(f"{self.kernel}: a {op} of {itemsize} bytes at {where} argument {name} "
                          f"({end - start} bytes), the nearest of its {len(self.spans)} tensor arguments")


_current: list[_Launch] = []
# kernel -> its arguments that hold base addresses of further tensors (kernels/pool.py: every layer's key buffer)
ADDRESS_TABLES = {"_pool_layers_kernel": ("KPtrs",)}


def _storage_spans(addresses: list[int], name: str) -> list[tuple[int, int, str]]:
    """The storages of live tensors that hold ``addresses``, found among every object the collector tracks."""
    import torch

    found = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            s = obj.untyped_storage()
            start = s.data_ptr()
            for i, a in enumerate(addresses):
                if start <= a < start + s.nbytes():
                    found[i] = (start, start + s.nbytes(), f"{name}[{i}]")
    missing = [i for i in range(len(addresses)) if i not in found]
    assert not missing, f"{name}[{missing[0]}] holds an address in no live tensor"
    return list(found.values())


def _spans(ifn, args, kwargs) -> list[tuple[int, int, str]]:
    import torch

    spans = []
    for name, v in bound_args(ifn, args, kwargs).items():
        if torch.is_tensor(v):
            s = v.untyped_storage()
            spans.append((s.data_ptr(), s.data_ptr() + s.nbytes(), name))
            if name in ADDRESS_TABLES.get(ifn.fn.__name__, ()):
                spans += _storage_spans(v.tolist(), name)
    return spans


def install() -> None:
    """Check every interpreted launch's loads and stores from now on."""
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder, _get_np_dtype

    run = InterpretedFunction.run
    if getattr(run, "bounds_checked", False):
        return

    def checked_run(self, *args, grid, warmup, **kwargs):
        _current.append(_Launch(self.fn.__name__, _spans(self, args, kwargs)))
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            _current.pop()

    def size(ptrs) -> int:
        return np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def checked_load(self, ptrs, mask, *rest):
        if _current:
            _current[-1].check(ptrs.data, mask.data, size(ptrs), "load")
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        if _current:
            _current[-1].check(ptrs.data, mask.data, size(ptrs), "store")
        return store(self, ptrs, value, mask, *rest)

    checked_run.bounds_checked = True
    InterpretedFunction.run = checked_run
    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = checked_load, checked_store
