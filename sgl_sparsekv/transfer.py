"""Host <-> device copies that never make a decode step wait for the GPU.

SGLang runs the host side of step t+1 while the GPU still computes step t (overlap scheduling), and a
captured decode graph only pays off if nothing stalls its launch. So host data goes to the device from
pinned memory (queued, not waited for), and device data the host needs (the KV slots of units cut at
decode) comes back one step late through :class:`LateRead`.
"""

from __future__ import annotations

import contextlib

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; from pinned memory, so the copy is queued behind the GPU's work."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class StagedUpload:
    """A device tensor rewritten from the host at every step, through a small ring of pinned host buffers.

    ``host()`` gives the next buffer to fill, ``upload()`` queues its copy into ``dest`` (one copy, no kernel, no
    allocation). A buffer is reused only once the GPU got past its last copy; were it still pending (it never is
    when the host runs at most a step or two ahead), the step pays a fresh pinned buffer instead of a wait."""

    def __init__(self, dest: torch.Tensor, ring: int = 4):
        assert dest.is_contiguous()
        self.dest = dest
        pinned = dest.is_cuda
        self.bufs = [torch.zeros(dest.shape, dtype=dest.dtype, pin_memory=pinned) for _ in range(ring if pinned else 1)]
        self.events: list[torch.cuda.Event | None] = [None] * len(self.bufs)
        self.turn = 0

    def host(self) -> torch.Tensor:
        ev = self.events[self.turn]
        if ev is not None and not ev.query():
            self.bufs[self.turn] = torch.empty_like(self.bufs[self.turn], pin_memory=True)
            self.events[self.turn] = None
        return self.bufs[self.turn]

    def upload(self) -> None:
        i = self.turn
        self.dest.copy_(self.bufs[i], non_blocking=True)
        if self.dest.is_cuda:
            if self.events[i] is None:
                self.events[i] = torch.cuda.Event()
            self.events[i].record()
        self.turn = (i + 1) % len(self.bufs)


class LateRead:
    """A device tensor copied to the host asynchronously; ``ready`` once the GPU got past the copy."""

    def __init__(self, t: torch.Tensor):
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = t.clone(), None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def get(self) -> torch.Tensor:
        """The host copy; waits for the copy if it is not done (by the next step it always is in practice)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


@contextlib.contextmanager
def sync_check(mode="error"):
    """CUDA's sync debug mode inside the block: "error" raises at any call that makes the host wait for the GPU,
    "warn" warns, 0 checks nothing (tests and benchmarks prove a step's host work never waits)."""
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
