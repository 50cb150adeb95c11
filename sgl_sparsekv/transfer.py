"""Host <-> device copies that never make a decode step wait for the GPU.

SGLang runs the host side of step t+1 while the GPU still computes step t (overlap scheduling), and a
captured decode graph only pays off if nothing stalls its launch. So host data goes to the device from
pinned memory (queued, not waited for), and device data the host needs (the KV slots of units cut at
decode) comes back one step late through :class:`LateRead`.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import torch

# (the plugin's variables start SPARSEKV_: SGLang rewrites every SGL_* one with a deprecation warning)
# SPARSEKV_DEBUG=1: check every pool range the kernels will read against the pools (syncs; tests use it)
DEBUG = os.environ.get("SPARSEKV_DEBUG") == "1"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; from pinned memory, so the copy is queued behind the GPU's work."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class StagedUpload:
    """A device tensor rewritten from the host at every step, through a ring of pinned host buffers.

    ``host()`` gives the next buffer to fill, as a numpy view; ``upload()`` queues its copy into ``dest`` (one copy,
    no kernel, no allocation). A buffer is refilled only once the GPU got past its last copy. Instead of an event
    per copy, a fence (an event) is recorded after every ``ring // 2`` copies and the last two are kept: a buffer's
    fence (the first one after its last copy) is queried only when the buffer comes round again and no fence seen
    done so far covers it, so with the host a step or two ahead of the GPU a step makes one event call in
    ``ring // 2``. Were the copy still pending, the step pays a fresh pinned buffer (counted in ``fresh``) instead
    of a wait. A fence covers the copies of its own stream only, so every copy must go to one stream (checked in
    debug mode); in serving that is SGLang's forward stream, where every forward runs.

    ``event``: the event type (a test's stand-in for the GPU); with one, copies count as asynchronous on any device.
    """

    def __init__(self, dest: torch.Tensor, ring: int = 16, event=None):
        assert dest.is_contiguous() and ring >= 2 and ring % 2 == 0
        self.dest = dest
        self.queued = dest.is_cuda or event is not None   # a copy may still be pending after upload() returns
        self.event = event or torch.cuda.Event
        self.bufs = [torch.zeros(dest.shape, dtype=dest.dtype, pin_memory=dest.is_cuda)
                     for _ in range(ring if self.queued else 1)]
        self.views = [b.numpy() for b in self.bufs]
        self.every = ring // 2
        self.copies = 0                 # copies queued so far
        self.done = -1                  # the last copy a fence was seen past
        self.fences = collections.deque(maxlen=2)   # (the copy it follows, event)
        self.fresh = 0
        self.stream = None              # debug mode: the one stream every copy goes to

    def host(self) -> np.ndarray:
        i = self.copies % len(self.bufs)
        last = self.copies - len(self.bufs)   # this buffer's last copy
        if self.queued and last > self.done:
            fence = next(((c, ev) for c, ev in self.fences if c >= last), None)
            if fence is not None and fence[1].query():
                self.done = fence[0]
            else:
                self.bufs[i] = torch.empty_like(self.bufs[i], pin_memory=self.dest.is_cuda)
                self.views[i] = self.bufs[i].numpy()
                self.fresh += 1
        return self.views[i]

    def upload(self) -> None:
        n = self.copies
        self.dest.copy_(self.bufs[n % len(self.bufs)], non_blocking=True)
        if self.queued:
            if DEBUG and self.dest.is_cuda:
                stream = torch.cuda.current_stream()
                assert self.stream in (None, stream), "staged uploads to two streams: a fence covers only its own"
                self.stream = stream
            if (n + 1) % self.every == 0:
                ev = self.event()
                ev.record()
                self.fences.append((n, ev))
        self.copies = n + 1


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

