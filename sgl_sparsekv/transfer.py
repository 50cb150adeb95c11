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
