"""Helpers that several test modules share."""

import contextlib

import torch

from sgl_sparsekv.index import ClusterIndex, graft


def graft_chunk(index: ClusterIndex, key: torch.Tensor, length: int, box: torch.Tensor | None = None) -> None:
    """``index.graft`` one chunk into one layer's index [H, ...] and record its cluster."""
    c = graft(index, key, length, box)
    index.chunk_fine = torch.cat([index.chunk_fine, c[:, None]], dim=1)


@contextlib.contextmanager
def sync_check(mode="error"):
    """CUDA's sync debug mode inside the block: "error" raises at any call that makes the host wait for the GPU,
    "warn" warns, 0 checks nothing (a step's host work must never wait)."""
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
