"""Uninitialized memory made visible: every ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` that the
plugin's own modules call returns a tensor filled with +inf (floating dtypes: an unwritten bound becomes the largest,
an unwritten pick a take), True (booleans) or the byte pattern 0xAA (integers: an unwritten index or count points far
outside every tensor, which tests/kernel_bounds.py then reports).

On the GPU a fresh allocation holds whatever the caching allocator last kept there; on the CPU a large one comes as
fresh zero pages, so a kernel or a torch twin that reads a scratch entry before writing it can pass every CPU test and
go wrong on the GPU. ``install`` (conftest.py) makes such a read change the result.
"""

from __future__ import annotations

import sys

import torch

PACKAGE = "sgl_sparsekv"


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("inf"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.full((t.element_size(),), 0xAA, dtype=torch.uint8).view(t.dtype).item())


def _ours() -> bool:
    """Whether the allocating wrapper's caller is one of the plugin's modules."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith(PACKAGE)


def _poisoning(alloc):
    """``alloc`` (an allocator, or ``Tensor.new_empty`` with its tensor first) poisoning what the plugin asks of it."""
    def poisoned(*args, **kwargs):
        t = alloc(*args, **kwargs)
        return _poison(t) if _ours() else t

    poisoned.poisoned = True
    return poisoned


def install() -> None:
    """Poison the plugin's uninitialized allocations from now on."""
    if getattr(torch.empty, "poisoned", False):
        return
    torch.empty, torch.empty_like = _poisoning(torch.empty), _poisoning(torch.empty_like)
    torch.Tensor.new_empty = _poisoning(torch.Tensor.new_empty)
