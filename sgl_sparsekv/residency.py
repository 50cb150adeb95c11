"""Which selected chunks a decode step finds in device memory, and what it must load (issue #93, the host tier).

With the host tier a sparse layer's KV of a request lives in host memory, and the device keeps, per request, sparse
layer and KV head, a small buffer of hot chunks: ``slots`` fixed-width slots of ``width`` device rows (the longest
chunk), each holding one chunk's KV. A decode step's selection names chunks; :meth:`HotChunks.plan` finds the ones
already in their head's buffer, gives each missing chunk the slot its head used least recently, and writes

    first  [n, K]       the device row where each selected chunk's KV starts (its tokens follow it), -1 for padding
    runs   [cap, 4]     (head, host row, device row, rows) for ``kernels.host_copy.copy_runs``: the missing chunks'
                        rows, cut where their host rows stop being consecutive (in chunk order here, in no fixed
                        order from the kernel, ``kernels/hot_plan.py``, which the GPU runs)
    count  [1]          how many runs are valid (``needed`` says how many there were, should ``cap`` be short)

Host rows are the request's KV slots in SGLang's pool (``req_to_token``), so a chunk is one run unless the allocator
gave its positions scattered slots. Everything is tensor work on the device (no host sync, fixed shapes), so a
captured decode graph can plan and load beside the selection. A chunk evicted from a slot and selected again later
is loaded again; the buffer never holds a chunk twice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_sparsekv.kernels.hot_plan import plan_slots


class Plan(NamedTuple):
    first: torch.Tensor     # [n, K] int32, device row of each selected chunk (-1: padding)
    runs: torch.Tensor      # [cap, 4] int32
    count: torch.Tensor     # [1] int32, runs to copy: min(needed, cap)
    needed: torch.Tensor    # [1] int64, runs the misses make (over cap: the caller's capacity is too small)
    hit_rows: torch.Tensor  # [1] int64, rows of selected chunks already resident
    miss_rows: torch.Tensor  # [1] int64, rows loaded


class HotChunks:
    """The hot-chunk buffers of ``requests`` request rows x ``layers`` sparse layers x ``heads`` KV heads.

    Request row ``r``'s slots start at device row ``base[r]`` in every layer's buffer (head columns are independent,
    as in SGLang's [rows, heads, head_dim] KV buffers), slot ``s`` at ``base[r] + s * width``.
    """

    def __init__(self, requests: int, layers: int, heads: int, slots: int, width: int, base: torch.Tensor,
                 use_kernel: bool = False):
        """``use_kernel``: plan in one launch (``kernels/hot_plan.py``), for lists whose chunks come before their
        padding; else in torch operations over every list (this plan is the kernel's twin)."""
        assert base.shape == (requests,) and slots >= 1 and width >= 1
        dev = base.device
        self.use_kernel = use_kernel
        self.slots, self.width, self.base = slots, width, base.to(torch.int64)
        self.chunk = torch.full((requests, layers, heads, slots), -1, dtype=torch.int32, device=dev)
        # the step a slot was last used at; an empty slot reads -1, so it goes first
        self.used = torch.full((requests, layers, heads, slots), -1, dtype=torch.int64, device=dev)

    def clear(self, row: int) -> None:
        """A request row leaves (or is reused): its buffers hold nothing."""
        self.chunk[row] = -1
        self.used[row] = -1

    def plan(self, layer: int, rows: torch.Tensor, heads: torch.Tensor, sel: torch.Tensor, starts: torch.Tensor,
             lens: torch.Tensor, req_to_token: torch.Tensor, step: int | torch.Tensor, cap: int,
             req_rows: torch.Tensor | None = None) -> Plan:
        """One sparse layer's step. Row i of the selection is request row ``rows[i]``'s KV head ``heads[i]`` (each
        pair at most once); ``sel[i, k]`` a chunk id (-1: padding), ``starts``/``lens`` its first position and
        length (at most ``width``). At most ``slots`` chunks a row. ``step`` grows from call to call. ``req_rows``:
        where the buffers' owners are not the requests' rows in ``req_to_token`` (the decode's list rows), those."""
        n, K = sel.shape
        S, W = self.slots, self.width
        assert K <= S, (K, S)
        dev = sel.device
        if self.use_kernel:
            step_t = step if torch.is_tensor(step) else torch.tensor([step], dtype=torch.int64, device=dev)
            first, runs, needed, hit_miss = plan_slots(self.chunk, self.used, self.base, layer, rows, heads,
                                                       rows if req_rows is None else req_rows, sel, starts, lens,
                                                       req_to_token, step_t, W, cap)
            return Plan(first, runs, needed.clamp(max=cap), needed, hit_miss[:1], hit_miss[1:])
        rows64, heads64 = rows.to(torch.int64), heads.to(torch.int64)
        resident = self.chunk[rows64, layer, heads64]                       # [n, S]
        used = self.used[rows64, layer, heads64]
        valid = sel >= 0
        eq = (sel[:, :, None] == resident[:, None, :]) & valid[:, :, None]   # [n, K, S]
        hit = eq.any(-1)
        hit_slot = eq.to(torch.int8).argmax(-1)
        miss = valid & ~hit
        # least recently used first, the slots this step hits last: a miss never evicts a chunk the step reads
        last = torch.iinfo(torch.int64).max
        order = torch.where(eq.any(1), last, used).argsort(dim=1, stable=True)
        victim = order.gather(1, (miss.cumsum(1) - 1).clamp(min=0))
        slot = torch.where(hit, hit_slot, victim)
        step_t = torch.as_tensor(step, dtype=torch.int64, device=dev).expand(n, K)
        self.used[rows64, layer, heads64] = _put(used, torch.where(valid, slot, S), step_t)
        self.chunk[rows64, layer, heads64] = _put(resident, torch.where(miss, victim, S), sel.to(torch.int32))

        first = torch.where(valid, self.base[rows64][:, None] + slot * W, -1)
        kv_rows = rows64 if req_rows is None else req_rows.to(torch.int64)
        runs, count, needed = _runs(miss, first, heads64, kv_rows, starts, lens, req_to_token, W, cap)
        rows_of = torch.where(valid, lens, 0).to(torch.int64)
        return Plan(first.to(torch.int32), runs, count, needed, (rows_of * hit).sum().view(1),
                    (rows_of * miss).sum().view(1))


def _put(t: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """``t`` with ``t[i, idx[i, k]] = val[i, k]``, where an index of ``t.shape[1]`` writes nothing."""
    x = torch.cat([t, t.new_zeros(t.shape[0], 1)], 1)
    x.scatter_(1, idx, val)
    return x[:, :-1]


def _runs(miss, first, heads, rows, starts, lens, req_to_token, W: int, cap: int):
    """The missing chunks' rows as runs of consecutive host rows, compacted into [cap, 4] in chunk order."""
    n, K = miss.shape
    i = torch.arange(W, device=miss.device)
    inside = miss[:, :, None] & (i < lens[:, :, None])                       # [n, K, W]
    pos = (starts[:, :, None].to(torch.int64) + i).clamp(max=req_to_token.shape[1] - 1)
    host = req_to_token[rows[:, None, None], pos].to(torch.int64)            # the positions' KV slots
    begins = inside & ((i == 0) | (host != host.roll(1, 2) + 1))
    # a run ends before the next begin of its chunk or at the chunk's end
    nxt = torch.where(begins, i, W).flip(2).cummin(2).values.flip(2)         # first begin at or after i
    nxt = torch.cat([nxt[:, :, 1:], torch.full_like(nxt[:, :, :1], W)], 2)  # ... strictly after i
    length = torch.minimum(nxt, lens[:, :, None].to(torch.int64)) - i
    flat = begins.flatten()
    at = flat.to(torch.int64).cumsum(0) - 1
    tgt = torch.where(flat & (at < cap), at, cap)
    cols = torch.stack([heads[:, None, None].expand(n, K, W), host, first[:, :, None].to(torch.int64) + i,
                        length], -1).view(-1, 4)
    runs = torch.zeros(cap + 1, 4, dtype=torch.int64, device=miss.device)
    runs.scatter_(0, tgt[:, None].expand(-1, 4), cols)
    needed = flat.sum().view(1)
    return runs[:cap].to(torch.int32), needed.clamp(max=cap).to(torch.int32), needed
