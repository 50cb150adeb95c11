"""The live recall audit: how much of dense attention's mass the selection kept, measured on the server's own traffic.

With config ``recall_audit_every`` N > 0, every N-th sparse decode step runs eagerly (the backend declines the CUDA
graph for it). After each sparse layer's attention, for up to ``AUDIT_ROWS`` of the step's rows that decode past
their budget, the audit computes the softmax over the row's whole sequence and sums it over the tokens the step
attended (its token lists plus its tail): the share of dense attention's mass the selection kept, averaged over
the row's query heads. The values stay on the device until a copy that nothing waits for reaches the host
(``transfer.LateRead``); later steps fold the copies that landed into one histogram per layer group, which
``/server_info`` and Prometheus read. An audited step costs, per audited row and sparse layer, a dense attention
beside the sparse one, and it runs eagerly where it would have replayed a graph (its cost in serving is not measured
yet).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from sgl_sparsekv.transfer import LateRead

AUDIT_ROWS = 4          # rows audited per audited step, taken in turn from the step's rows past their budget
LAYER_GROUPS = 4        # the sparse layers are reported in this many consecutive groups
BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)   # upper bounds of the histogram's buckets
KEY_BLOCK = 8192        # keys per block of the dense logits (bounds the fp32 copy of a long sequence's keys)


class AuditedRow(NamedTuple):
    """A batch row the audit measures this step: what the attention read for it."""

    i: int            # its batch row
    row: int          # its row in req_to_token
    seq: int          # its length
    list_row: int     # its token lists' row
    tail_from: int    # its tokens from here on were attended beside its lists


def kept_mass(q: torch.Tensor, k_buf: torch.Tensor, seq_slots: torch.Tensor, lists: torch.Tensor,
              valid: torch.Tensor, tail_from: int, scale: float, k_lists: torch.Tensor | None = None) -> torch.Tensor:
    """One row's kept attention mass per query head, on the device without a host read.

    ``q`` [Hq, d]; ``seq_slots`` [S] the row's KV slots by position; ``lists`` [H, cap] each KV head's attended
    slots, of which ``valid`` [H, cap] marks the entries in use, rows of ``k_lists`` where given (the host tier's hot
    buffers, whose rows hold copies of those tokens' keys), else of ``k_buf``; positions from ``tail_from`` on were
    attended beside the lists. Returns [Hq]: the softmax (over all S tokens, logits ``q.k * scale``) summed over the
    attended tokens."""
    H = k_buf.shape[1]
    Hq, d = q.shape
    qf = q.float().view(H, Hq // H, d)
    logits = torch.cat([torch.einsum("hgd,shd->hgs", qf, k_buf[seq_slots[s:s + KEY_BLOCK].long()].float())
                        for s in range(0, seq_slots.shape[0], KEY_BLOCK)], dim=-1) * scale
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    tail = torch.exp(logits[..., tail_from:] - lse).sum(-1)
    # entries past a list's length may hold any value: read slot 0 there and drop it
    slots = torch.where(valid, lists, torch.zeros_like(lists)).long()
    k = (k_buf if k_lists is None else k_lists)[slots, torch.arange(H, device=slots.device)[:, None]].float()
    picked = torch.exp(torch.einsum("hgd,hcd->hgc", qf, k) * scale - lse) * valid[:, None, :]
    return (picked.sum(-1) + tail).flatten()


def layer_groups(sparse_layers: int, first_layer: int, groups: int = LAYER_GROUPS) -> list[tuple[range, str]]:
    """The sparse layers in at most ``groups`` consecutive groups: (sparse layer indexes, label of model layers)."""
    n = max(1, min(groups, sparse_layers))
    bounds = [sparse_layers * g // n for g in range(n + 1)]
    return [(range(lo, hi), f"{first_layer + lo}-{first_layer + hi - 1}") for lo, hi in zip(bounds, bounds[1:])]


class GroupHistogram:
    """Kept-mass values of one layer group: their count, sum, minimum and count per bucket (not cumulative)."""

    def __init__(self):
        self.count, self.sum, self.min = 0, 0.0, 1.0
        self.buckets = [0] * len(BUCKETS)

    def add(self, values: list[float]) -> None:
        for v in values:
            self.count += 1
            self.sum += v
            self.min = min(self.min, v)
            self.buckets[next((b for b, hi in enumerate(BUCKETS) if v <= hi), len(BUCKETS) - 1)] += 1

    def summary(self) -> dict:
        return {"samples": self.count, "mean": self.sum / self.count if self.count else None,
                "min": self.min if self.count else None,
                "buckets": {str(hi): n for hi, n in zip(BUCKETS, self.buckets)}}


class RecallAudit:
    def __init__(self, every: int, sparse_layers: int, first_layer: int):
        self.every = every
        self.layers = sparse_layers
        self.groups = layer_groups(sparse_layers, first_layer)
        self.histograms = {label: GroupHistogram() for _, label in self.groups}
        self.since = 0          # sparse decode steps since the last audited one
        self.turn = 0           # where the next audited step starts taking rows
        self.rows: list[AuditedRow] = []   # this step's
        self.values = None      # this step's [rows, sparse layers] on the device
        self.pending: deque = deque()   # copies on their way to the host
        self.observed: list[tuple[str, float]] | None = None   # values not yet drained, once a consumer asks

    def due_next(self) -> bool:
        """Whether the next sparse decode step is audited (asked before it: the backend runs it eagerly)."""
        return self.since + 1 >= self.every

    def pick(self, candidates: list[AuditedRow], eager: bool, device) -> list[AuditedRow]:
        """Called once per sparse decode step with its rows past their budget that attend to lists: the rows audited
        this step (none unless the step is due and eager; a due step inside a graph passes the turn on)."""
        self.since += 1
        self.rows = []
        if self.since < self.every or not eager:
            return self.rows
        self.since = 0
        if candidates:
            start = self.turn % len(candidates)
            self.rows = (candidates[start:] + candidates[:start])[:AUDIT_ROWS]
            self.turn += len(self.rows)
            self.values = torch.zeros(len(self.rows), self.layers, dtype=torch.float32, device=device)
        return self.rows

    def record(self, sparse_layer: int, q: torch.Tensor, k_buf: torch.Tensor, lens: torch.Tensor,
               windows: torch.Tensor, heads: int, cap: int, req_to_token: torch.Tensor, scale: float,
               k_lists: torch.Tensor | None = None) -> None:
        """After a sparse layer's attention: each audited row's kept mass in that layer (``lens``/``windows``: the
        layer's lists as the attention read them, ``cap`` entries per list, ``heads`` lists per list row, rows of
        ``k_lists`` where given)."""
        at = torch.arange(cap, device=lens.device)
        for r, a in enumerate(self.rows):
            j = a.list_row * heads
            lists = windows[j * cap:(j + heads) * cap].view(heads, cap)
            valid = at[None, :] < lens[j:j + heads, None]
            mass = kept_mass(q[a.i], k_buf, req_to_token[a.row, :a.seq], lists, valid, a.tail_from, scale, k_lists)
            self.values[r, sparse_layer] = mass.mean()
        if sparse_layer == self.layers - 1:
            self.pending.append(LateRead(self.values))
            self.rows, self.values = [], None

    def harvest(self) -> None:
        """Fold every copy that reached the host into the histograms (never waits)."""
        while self.pending and self.pending[0].ready():
            values = self.pending.popleft().get()
            for layers, label in self.groups:
                got = values[:, layers.start:layers.stop].flatten().tolist()
                self.histograms[label].add(got)
                if self.observed is not None:
                    self.observed += [(label, v) for v in got]

    def drain(self) -> list[tuple[str, float]]:
        """The (layer group, value) pairs harvested since the last drain (from the first call on they are kept for
        the next: an exporter drains them)."""
        if self.observed is None:
            self.observed = []
        self.harvest()
        out, self.observed = self.observed, []
        return out

    def snapshot(self) -> dict:
        self.harvest()
        return {label: h.summary() for label, h in self.histograms.items()}
