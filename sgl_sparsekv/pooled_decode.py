"""Sparse decode from the index pools, for every method, in static buffers that a CUDA graph captures (on the GPU).

Before each step (eager, outside the graph) ``prepare`` runs the manager's pooled preparation and
writes every batch row's ``StepRow`` (its pool ranges, ``kernels.select.RequestRanges``: its shared and own
segments and its rows of the step's selection scratch; then its length, budget and list row) into fixed
``[max_bs]`` tensors. Inside the graph each sparse
layer runs ``select_fine`` -> ``emit_tokens`` -> ``sparse_decode_attention`` on them: no host reads,
shapes fixed by the captured batch size, every list at most ``token_budget`` slots. With ``rerank_factor`` f > 1
the cut and emission pick f times the budget's retrieved tokens as candidates and ``rerank_tokens`` keeps the
budget's best of them by the group's attention before the attention runs. With hybrid heads
(config ``head_roles``) a layer selects and emits only for its retrieval heads; a sparse head's list is the one
its KV head used in the layer before, left in place in ``windows``, and a layer without retrieval heads launches
no selection at all. A request past its budget whose index found no room in the pools (or in the step's
scratch) is flagged ``direct``: the attention kernel reads its whole sequence from its ``req_to_token`` row
(dense, counted in ``dense_fallback_steps``). The same steps run on the CPU with the kernels' torch twins
(``manager.use_kernels`` off).

Token lists live in *list rows*, one per request that decodes, ``H`` lists each. With ``select_every`` k > 1 a
request keeps its list row (and its lists of every sparse layer) across steps: it selects at one step (``fresh``)
and for the next k - 1 steps skips selection and emission and attends to its kept lists plus the tokens decoded
since (``tail_from``). Its batch row may change in between; its list row does not. With k = 1 the list row is the
batch row and every row is fresh.

With ``select_ahead`` a request keeps its list row too, and each sparse layer runs in the other order: the attention
reads the lists the request selected at the step before plus the token decoded since, then selection and emission
write the next step's lists with this step's query, on a second CUDA stream that forks after the attention and joins
the step's stream once the model's forward is issued (``join``; the backend wraps the model's forward), so no
selection stays on the step's critical path: the last layer's overlaps the final norm and the LM head. A
request's first decode step past the budget has no lists from a step before; that step selects with its own query,
as lychee does: the backend declines the CUDA graph for a batch holding such a request (``first_steps``), and an
eager step that holds one runs every sparse layer in lychee's order (``own_order``) for each row that can select,
keeping those lists for the next step. A request still without lists (one whose step could not select, or a first
step inside a graph) attends to its whole sequence once (``direct``, counted in ``unselected_steps``).

With the recall audit on (config ``recall_audit_every``), the audited rows of an eager step are measured after each
sparse layer's attention, against the lists that attention read (``sgl_sparsekv/recall_audit.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch

from sgl_sparsekv import head_roles
from sgl_sparsekv.kernels import rerank
from sgl_sparsekv.kernels.select import (RANGE_FIELDS, RequestRanges, Segment, all_heads, batch_ranges, emit_tokens,
                                         emit_tokens_ref, scratch, select_fine)
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_ref, workspace_for
from sgl_sparsekv.manager import DEBUG, KeptLists, SparseKVManager, logger
from sgl_sparsekv.pool_ops import select_fine_ref
from sgl_sparsekv.recall_audit import AuditedRow
from sgl_sparsekv.request_control import OFF
from sgl_sparsekv.tier_rows import HotBuffers
from sgl_sparsekv.transfer import StagedUpload

SPLITS = 8  # flash-decoding splits of a list
# a step's selection scratch (bounds and picks: 8 bytes per KV head) holds this many times the fine pool's
# rows: requests that share a prefix's segment each need scratch rows for all of its clusters
SCRATCH_PER_FINE_ROW = 4
NR = len(RANGE_FIELDS)


class StepRow(NamedTuple):
    """One batch row of a decode step's table, a column of ``PooledDecode.table``: where its index lies in the
    pools, then what the kernels read beside it."""

    ranges: RequestRanges
    row: int         # its row in req_to_token
    seq: int         # its length
    budget: int      # tokens the cut retrieves past the sink and the recent window
    direct: int      # attends to its whole sequence (past the budget without an index, or without lists)
    fresh: int       # selects this step
    list_row: int    # its token lists' row
    tail_from: int   # its tokens from here on are attended beside its lists
    ring_from: int   # the host tier: its positions from here on are loaded into its owner's ring

    def column(self) -> list[int]:
        return [*self.ranges.column(), *self[1:]]


EXTRA = StepRow._fields[1:]
UNPLACED = RequestRanges(Segment(), Segment(), 0)   # the ranges of a request without an index in the pools
# a batch row past the requests: one token of request row 0
PADDING_ROW = StepRow(UNPLACED, row=0, seq=1, budget=0, direct=1, fresh=0, list_row=0, tail_from=0,
                      ring_from=1).column()


def parts_for(bs: int) -> int:
    """Programs per (request, KV head) in the fine bounds and emission at batch size ``bs``: about 128 over the
    batch, at least 16. Timed on an H200 at 32K and 126K (bench/results/parts_sweep_h200.json): at batch 1, 128
    shorten each program's walk over its tiles (the chain 0.0487 -> 0.0474 ms per layer at 32K, 0.0677 -> 0.0615 at
    126K, against 32); at batch 16, 16-32 are best and 128 cost 25% more."""
    return max(16, 128 // (1 << (bs - 1).bit_length()))


def _index_ranges(state, scratch_at: int) -> RequestRanges | None:
    """A request's pool ranges (segment 0, the adopted prefix's, empty without one; segment 1, its own) with its
    scratch rows from ``scratch_at``; None while its index is not in the pools (a shared segment comes only with an
    own one)."""
    if state.pool is None:
        return None
    prefix = state.shared.segment() if state.shared is not None else Segment()
    return RequestRanges(prefix, state.pool.segment(), scratch_at)


class PooledDecode:
    def __init__(self, manager: SparseKVManager, max_bs: int, q_heads: int, parts: int | None = None):
        """``parts``: programs per (request, KV head) in selection and emission; by default ``parts_for`` the
        batch size of each step (each captured graph's). Beside a select_ahead step they run on a stream of lower
        priority than the step's (``join_after_forward``), so their waves never hold back the step's kernels."""
        self.manager = manager
        pools, cfg = manager.pools, manager.cfg
        self.cfg = cfg
        dev = manager.device
        H, d = pools.heads, pools.head_dim
        # select_ahead on the GPU: the stream that selects beside the attention; ``forked``: the step's stream has
        # not waited for it since (``join``)
        self.side = torch.cuda.Stream(dev) if cfg.select_ahead and torch.device(dev).type == "cuda" else None
        self.parts = (lambda bs: parts) if parts is not None else parts_for
        self.H, self.cap = H, cfg.token_budget
        self.retrieve = cfg.token_budget - cfg.sink_tokens - cfg.recent_window   # tokens retrieved past both
        f = cfg.rerank_factor
        self.cut = self.retrieve * f   # the cut's budget: the candidates' with a rerank
        self.expand = cfg.expansion(self.cut)
        self.max_bs = max_bs

        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        # per batch row: pool ranges and scratch rows, then EXTRA; filled by one copy per step
        self.table = torch.zeros(NR + len(EXTRA), max_bs, dtype=torch.int32, device=dev)
        self.fields = tuple(self.table)
        self.ranges = self.table[:NR]
        self.staging = StagedUpload(self.table)
        (self.rows, self.seq, self.budget, self.direct, self.fresh, self.list_rows, self.tail_from,
         self.ring_from) = self.fields[NR:]
        self.scratch = scratch(SCRATCH_PER_FINE_ROW * pools.capacity.fine, H, dev)
        # kept lists: one set per sparse layer when they outlive the step, else one set that every layer rewrites
        self.every, self.ahead = cfg.select_every, cfg.select_ahead
        self.layers_kept = self.every > 1 or self.ahead
        kept = pools.layers if self.layers_kept else 1
        self.lens, self.windows = i32(kept * max_bs * H), i32(kept * max_bs * H * self.cap)
        self.counts = i32(H * max(bs * self.parts(bs) for bs in range(1, max_bs + 1)))
        self.owner = [None] * max_bs   # the RequestState whose lists a list row holds (select_every > 1, host tier)
        # the host tier: the sparse layers' device KV is the hot buffers of list rows that requests keep while they
        # decode (sgl_sparsekv/tier_rows.py); there are no more of those than requests SGLang can run
        self.tier = None
        self.no_direct = i32(max_bs)   # the host tier's lists: no row of theirs attends its whole sequence
        if cfg.host_tier:
            owners = min(max_bs, manager.max_requests or max_bs)
            self.tier = HotBuffers(owners, pools.layers, H, d, manager.kv_dtype, cfg, dev, manager.use_kernels)
            self.owner = [None] * owners
            logger.info("sparse-kv: hot buffers of %.1f MiB for %d decoding requests (%d slots of %d tokens and a "
                        "ring of %d a request)", self.tier.nbytes / 2**20, owners, self.tier.slots, cfg.chunk_max,
                        self.tier.ring)
        if kept > 1:
            logger.info("sparse-kv: token lists kept across steps: %.1f MiB for %d batch rows",
                        (self.lens.numel() + self.windows.numel()) * 4 / 2**20, max_bs)
        self.forked = False
        self.own_order = False   # select_ahead: this (eager) step selects before it attends, as lychee does
        self.audited = []   # the rows the recall audit measures this step (eager steps only)
        self.starts = torch.arange(max_bs * H, dtype=torch.int32, device=dev) * self.cap
        self.workspace = workspace_for(max_bs, H, q_heads // H, d, SPLITS, dev) if manager.use_kernels else None
        ops = (select_fine, emit_tokens) if manager.use_kernels else (select_fine_ref, emit_tokens_ref)
        self.select, self.emit = ops
        # two-stage selection: emission's candidate lists, ``cap_c`` entries each, and the rerank's scratch
        self.cap_c = cfg.token_budget + (f - 1) * self.retrieve
        if f > 1:
            self.candidates = (i32(max_bs * H), i32(max_bs * H * self.cap_c))
            self.rerank = rerank.rerank_tokens if manager.use_kernels else rerank.rerank_tokens_ref
            self.rerank_space = (rerank.workspace_for(max_bs, H, q_heads // H, self.cap_c, dev)
                                 if manager.use_kernels else None)
        shard = manager.kv_shard
        roles = head_roles.resolve(cfg.head_roles, manager.num_layers, shard.total, cfg.dense_layers, heads=shard.heads)
        every = all_heads(H, dev)
        # per sparse layer: its retrieval KV heads (int32), None where it has none
        self.layer_heads = [every] * pools.layers if roles is None else [
            torch.tensor(r, dtype=torch.int32, device=dev) if r else None for r in roles]

    def token_list(self, j: int, sparse_layer: int = 0) -> torch.Tensor:
        """The KV slots of list ``j`` (list row * KV heads + head) in ``sparse_layer``'s lists."""
        lens, windows = self._layer_lists(sparse_layer)
        return windows[j * self.cap:j * self.cap + int(lens[j])]

    def _layer_lists(self, sparse_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lens, windows) of a sparse layer: its own when lists are kept across steps."""
        i = sparse_layer if self.layers_kept else 0
        n = self.max_bs * self.H
        return self.lens[i * n:(i + 1) * n], self.windows[i * n * self.cap:(i + 1) * n * self.cap]

    def _held_row(self, state) -> int | None:
        """The list row whose lists ``state`` holds in this decoder; None if its lists are elsewhere or gone."""
        kept = state.lists
        return kept.row if kept is not None and kept.decoder is self and self.owner[kept.row] is state else None

    def _ahead_row(self, state, S: int, batch: set[int]) -> tuple[int, int | None]:
        """select_ahead: (list row, length when its lists were selected, None if they were not) of a request at
        length ``S``; ``state.lists`` then names the row and no selection yet (``prepare`` sets it once placed)."""
        r = self._held_row(state)
        if r is not None:
            selected = state.lists.selected_at
            selected = selected if selected is not None and selected < S else None
        else:
            r, selected = self._claim(state, batch), None
        state.lists = KeptLists(self, r, None)
        return r, selected

    def first_steps(self, states, seq_lens: list[int]) -> bool:
        """select_ahead: whether a batch holds a request past the budget whose index is placed and that has no lists
        from a step before here (its first decode step, or its first back from another decoder's buffers)."""
        needs = self.manager.needs_sparse
        return any(st is not None and needs(S) and st.segments and (self._held_row(st) is None or st.lists.selected_at is None)
                   for st, S in zip(states, seq_lens))

    def _list_row(self, state, S: int, i: int, batch: set[int]) -> tuple[int, int, int]:
        """(list row, fresh, tail_from) of a request at length ``S`` in batch row ``i``: it selects anew when its
        lists are due (:meth:`_due`) or it holds no list row (a new request, or its row was taken). With the host
        tier a request keeps its list row (its hot buffers) at every period, and its tail is read from its ring."""
        if self.every == 1 and self.tier is None:
            return i, 1, S
        r = self._held_row(state)
        if r is None:
            r = self._claim(state, batch)
        elif not self._due(state.lists.selected_at, S):
            return r, 0, state.lists.selected_at
        state.lists = KeptLists(self, r, S)
        return r, 1, S

    def _claim(self, state, batch: set[int]) -> int:
        """A list row for ``state``: a free one (no owner, its owner finished, or its owner's lists are elsewhere
        now: another decoder's, after a batch past the captured sizes), else one whose owner is not in this batch
        (``batch``: ids of the batch's states). Each state of the batch holds at most one row, so one is found."""
        live = self.manager.states
        for r, owner in enumerate(self.owner):
            if owner is None or live.get(owner.row) is not owner or self._held_row(owner) != r:
                break
        else:
            r = next(r for r, owner in enumerate(self.owner) if id(owner) not in batch)
        self.owner[r] = state
        return r

    def fill_idle(self, bs: int) -> None:
        """Safe contents for capture: every row a one-token dense request on request row 0."""
        for t in self.fields:
            t[:bs].zero_()
        self.seq[:bs].fill_(1)
        self.ring_from[:bs].fill_(1)
        self.own_order = False
        self.audited = []

    def prepare(self, rows: list[int], seq_lens: list[int], padded_bs: int, req_to_token, tokens, k_buffers,
                attends: bool = True, eager: bool = False, budgets: list | None = None) -> None:
        """Host work of a decode step (no device read): tokens are the requests' host token ids. ``attends``: the
        step runs the sparse layers through ``attend`` (an eager step that SGLang's own backend decodes does not:
        it writes no lists, so none are kept from it). ``eager``: the step runs outside a CUDA graph, so with
        select_ahead a first decode step may select before it attends. ``budgets``: per request its own token
        budget (``request_control``; None: the server's): a row's cut takes its budget's tokens, and a request
        that asked for ``OFF`` attends to its whole sequence, in the same captured graphs."""
        m = self.manager
        t0 = time.perf_counter()
        states = m.prepare_decode_pooled(rows, seq_lens, req_to_token, tokens, k_buffers, budgets)
        self.own_order = False
        self.audited = []
        if attends:
            if self.tier is not None:
                self.tier.start_step()
            table = (self._table_ahead(rows, seq_lens, states, eager) if self.ahead
                     else self._table(rows, seq_lens, states))
            self._upload(table, len(rows), padded_bs, req_to_token.shape)
            if m.audit is not None and any(map(m.needs_sparse, seq_lens)):
                self._pick_audited(table, eager)
        else:
            for state in states:
                state.lists = None
        m.stats.decode_prepare_s += time.perf_counter() - t0

    def _pick_audited(self, table: list[StepRow], eager: bool) -> None:
        """The rows the recall audit measures this step: of those past their budget that attend to token lists."""
        m = self.manager
        candidates = [AuditedRow(i, r.row, r.seq, r.list_row, r.tail_from) for i, r in enumerate(table)
                      if not r.direct and m.needs_sparse(r.seq)]
        self.audited = m.audit.pick(candidates, eager, m.device)
        m.stats.audited_steps += bool(self.audited)

    def _table(self, rows, seq_lens, states) -> list[StepRow]:
        m = self.manager
        every = self.every
        table = []
        so, room, reused = 0, self.scratch[0].shape[1], 0
        tier = self.tier is not None
        batch = {id(st) for st in states} if every > 1 or tier else None
        for i, (row, S, state) in enumerate(zip(rows, seq_lens, states)):
            if state.budget == OFF:
                table.append(self._dense_row(row, S, state))
                continue
            list_row, fresh, tail_from = (i, 1, S) if every == 1 and not tier else self._list_row(state, S, i, batch)
            ring_from = self.tier.take(list_row, state, row, S) if tier else S
            ranges = _index_ranges(state, so)
            indexed = ranges is not None
            placed = indexed and (not fresh or so + ranges.fines <= room)
            if placed and fresh:
                so += ranges.fines
            else:
                ranges = UNPLACED
            direct = m.needs_sparse(S) and not placed   # past the budget without its index: the whole sequence
            if direct:
                m.stats.dense_fallback_steps += 1
                if indexed and fresh:
                    self._scratch_full()
                if state.lists is not None:   # its lists are not written this step: it keeps the row, selects
                    state.lists = KeptLists(self, list_row, -every)   # at the next step
            table.append(StepRow(ranges, row, S, self._budget(state, self.cut), direct, fresh and not direct,
                                 list_row, tail_from, ring_from))
            reused += not (fresh or direct)
        self._count(table, states, reused)
        return table

    def _table_ahead(self, rows, seq_lens, states, eager: bool) -> list[StepRow]:
        """select_ahead: each row attends to the lists selected at its step before (else its whole sequence) and
        selects for its next step where its index (or a length within the budget) allows. An eager step holding a
        first decode step (``first_steps``) runs in lychee's order: every row that selects attends to the lists it
        selects now."""
        m = self.manager
        self.own_order = eager and self.first_steps(states, seq_lens)
        m.stats.own_order_steps += self.own_order
        table = []
        so, room, reused = 0, self.scratch[0].shape[1], 0
        batch = {id(st) for st in states}
        tier = self.tier is not None
        for row, S, state in zip(rows, seq_lens, states):
            if state.budget == OFF:
                table.append(self._dense_row(row, S, state))
                continue
            list_row, selected = self._ahead_row(state, S, batch)
            ring_from = self.tier.take(list_row, state, row, S) if tier else S
            if selected is not None and not self._due(selected, S):   # its lists serve its next step too
                state.lists = KeptLists(self, list_row, selected)
                table.append(StepRow(UNPLACED, row, S, self._budget(state, self.retrieve), 0, 0, list_row, selected,
                                     ring_from))
                reused += 1
                continue
            ranges = _index_ranges(state, so)
            indexed = ranges is not None
            placed = indexed and so + ranges.fines <= room
            if placed:
                so += ranges.fines
            else:
                ranges = UNPLACED
                if indexed:
                    self._scratch_full()
            selects = placed or not m.needs_sparse(S)   # within the budget its list is every token
            if selects:
                state.lists = KeptLists(self, list_row, S)
                if self.own_order:   # attends to the lists it selects now
                    selected = S
            else:   # past the budget without its index: its next step attends to the whole sequence
                m.stats.dense_fallback_steps += 1
            if selected is None:
                m.stats.unselected_steps += m.needs_sparse(S)
            table.append(StepRow(ranges, row, S, self._budget(state, self.retrieve), selected is None, selects,
                                 list_row, S if selected is None else selected, ring_from))
        self._count(table, states, reused)
        return table

    def _due(self, selected: int, S: int) -> bool:
        """Whether a request at length ``S`` whose lists were selected at length ``selected`` selects anew (for this
        step, or with select_ahead for its next): lists serve ``select_every`` steps. With the host tier a list
        selected within the budget names ring rows of every position, which the ring (``token_budget`` long, one
        more with select_ahead) keeps only for the step that list serves first: such a list is selected anew each
        step."""
        return S >= selected + self.every or (self.tier is not None and selected <= self.cfg.token_budget)

    def _budget(self, state, server: int) -> int:
        """A row's cut: ``server`` (the server's: retrieved tokens, times the rerank factor for the candidates), or
        the same for the request's own budget."""
        if state.budget is None:
            return server
        return (state.budget - self.cfg.sink_tokens - self.cfg.recent_window) * (server // self.retrieve)

    def _dense_row(self, row: int, S: int, state) -> StepRow:
        """The row of a request that asked for dense decoding: its whole sequence, no selection, no lists kept."""
        state.lists = None
        self.manager.stats.requested_dense_steps += self.manager.needs_sparse(S)
        return StepRow(UNPLACED, row, S, 0, direct=1, fresh=0, list_row=0, tail_from=S, ring_from=S)

    def _upload(self, table: list[StepRow], bs: int, padded_bs: int, r2t_shape) -> None:
        """The step's table, padded to the captured batch size, to the device."""
        table = [r.column() for r in table] + [PADDING_ROW] * (padded_bs - bs)
        fresh = self.staging.fresh
        view = self.staging.host()
        self.manager.stats.upload_fresh_buffers += self.staging.fresh - fresh
        view.T[:padded_bs] = table   # one numpy write, transposed: the buffer holds each field for every row
        if DEBUG:
            check_table(view[:, :padded_bs], bs, self.manager.pools.capacity, self.scratch[0].shape[1], r2t_shape)
        self.staging.upload()

    def _count(self, table: list[StepRow], states, reused: int) -> None:
        """A step's counters: tokens of context, tokens attended (the whole sequence of a direct row or one within
        the budget, else its budget), tokens scored by a rerank (its candidates), rows that reused lists."""
        cfg = self.cfg
        m, budget, f = self.manager, cfg.token_budget, cfg.rerank_factor
        cap = self.cap_c if f > 1 else 0
        context = attended = scored = 0
        for step, state in zip(table, states):
            S = step.seq
            context += S
            if step.direct or S <= budget:
                attended += S
                continue
            own = state.budget   # its own budget (request_control), else the server's
            attended += own or budget
            if cap:   # a row past the budget that selects scores its candidates
                scored += min(S, own + (f - 1) * (own - cfg.sink_tokens - cfg.recent_window) if own else cap)
        m.stats.context_tokens += context
        m.stats.attended_tokens += attended
        if cap:
            m.stats.scored_tokens += scored
        m.stats.reused_list_steps += reused

    def _scratch_full(self) -> None:
        """A request whose index is in the pools found no room in the step's selection scratch: it decodes densely
        this step (never on less context)."""
        m = self.manager
        if not m.stats.scratch_full_steps:
            logger.warning("sparse-kv: a decode batch's fine clusters outgrew the selection scratch; the requests "
                           "past it decode densely that step (counted in scratch_full_steps)")
        m.stats.scratch_full_steps += 1

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, sparse_layer: int,
               req_to_token: torch.Tensor, scale: float) -> torch.Tensor:
        """q [bs, Hq, d] -> [bs, Hq, d]; graph-safe."""
        if self.tier is not None:
            r = slice(0, q.shape[0])
            self.tier.fill_ring(sparse_layer, k_buf, v_buf, self.rows[r], self.seq[r], self.list_rows[r],
                                self.ring_from[r], req_to_token)
        if not self.ahead or self.own_order:
            if self.layer_heads[sparse_layer] is not None:
                self._select(q, k_buf, sparse_layer, req_to_token, scale, v_buf)
            out = self._attention(q, k_buf, v_buf, sparse_layer, req_to_token, scale)
            self._audit(q, k_buf, sparse_layer, req_to_token, scale)
            return out
        out = self._attention(q, k_buf, v_buf, sparse_layer, req_to_token, scale)
        self._audit(q, k_buf, sparse_layer, req_to_token, scale)   # before the next step's lists replace these
        with self._beside(q):
            self._select(q, k_buf, sparse_layer, req_to_token, scale, v_buf)
        return out

    def _audit(self, q, k_buf, sparse_layer: int, req_to_token, scale: float) -> None:
        if self.audited:
            lens, windows = self._layer_lists(sparse_layer)
            k_lists = self.tier.k[sparse_layer] if self.tier is not None else None   # lists of hot-buffer rows
            self.manager.audit.record(sparse_layer, q, k_buf, lens, windows, self.H, self.cap, req_to_token, scale,
                                      k_lists)

    @contextlib.contextmanager
    def _beside(self, q: torch.Tensor):
        """Work issued inside runs on the side stream once the step's stream reached this point; the step's stream
        waits for it at ``join``."""
        if self.side is None:
            yield
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        q.record_stream(self.side)   # the step's stream may reuse q's memory while the side stream still reads it
        with torch.cuda.stream(self.side):
            yield
        self.forked = True

    def join(self) -> None:
        """The step's stream waits for the selections issued beside it. Called once the model's forward is issued
        (the backend wraps it), so the last layer's selection overlaps the final norm and the LM head, and a
        captured graph ends joined."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
            self.forked = False

    def _select(self, q, k_buf, sparse_layer: int, req_to_token, scale: float, v_buf=None) -> None:
        """The fresh rows' token lists of this layer (its retrieval heads'), from the pools; with the host tier, in
        rows of the hot buffers, whose misses are loaded from ``k_buf``/``v_buf`` (the host pool)."""
        bs = q.shape[0]
        cfg, n, parts = self.cfg, bs * self.H, self.parts(bs)
        r = slice(0, bs)
        lens, windows = self._layer_lists(sparse_layer)
        heads = self.layer_heads[sparse_layer]
        coarse, fine, chunks = self.manager.pools.layer(sparse_layer)
        # gqa_reduce "mean": the group's mean query ranks (a group of one), as in the reference's upper_bound
        qs = q.view(bs, self.H, -1, q.shape[-1]).float().mean(2) if cfg.gqa_reduce == "mean" else q
        sel = self.select(qs, coarse, fine, self.ranges, self.budget[r], self.expand, cfg.max_coarse,
                          parts, out=self.scratch, radius_weight=cfg.radius_weight, heads=heads,
                          box=self.manager.pools.box_layer(sparse_layer))
        if self.tier is not None:
            self.tier.load(sparse_layer, sel, chunks, self.ranges, self.seq[r], req_to_token, k_buf, v_buf, cfg,
                           (self.list_rows[r], self.fresh[r]), (lens, windows), heads)
            return
        reranked = cfg.rerank_factor > 1   # (select_every is 1 then: list rows are batch rows)
        cand = (self.candidates[0][:n], self.candidates[1][:n * self.cap_c]) if reranked else (lens, windows)
        self.emit(sel, chunks, self.ranges, self.rows[r], self.seq[r], req_to_token,
                  cfg.sink_tokens, cfg.recent_window, self.cap_c, dense_limit=cfg.token_budget,
                  max_chunk=cfg.chunk_max, parts=parts, heads=heads,
                  out=(*cand, self.counts[:n * parts]), lists_at=(self.list_rows[r], self.fresh[r]))
        if reranked:
            self.rerank(q, k_buf, cand, self.seq[r], scale, cfg.sink_tokens, cfg.recent_window, self.retrieve,
                        self.cap, cfg.token_budget, (lens, windows), self.rerank_space, heads)

    def _attention(self, q, k_buf, v_buf, sparse_layer: int, req_to_token, scale: float) -> torch.Tensor:
        """Each row attends to its lists of this layer plus its tail, or to its whole sequence (``direct``)."""
        bs = q.shape[0]
        r = slice(0, bs)
        lens, windows = self._layer_lists(sparse_layer)
        if self.tier is not None:   # lists in the hot buffers, their tails in the rings; a direct row reads the
            rows = self.direct[r].bool()[:, None, None]   # host pool
            tails = (self.no_direct[r], self.tier.ring_base.index_select(0, self.list_rows[r]), self.seq[r],
                     req_to_token, self.tail_from[r])
            out = self._attend_lists(q, self.tier.k[sparse_layer], self.tier.v[sparse_layer], lens, windows, tails,
                                     r, scale, self.tier.ring)
            # a captured step reads no device value: it always runs the direct rows' call (empty lists elsewhere)
            if (q.is_cuda and torch.cuda.is_current_stream_capturing()) or bool(rows.any()):
                whole = (self.direct[r], self.rows[r], self.seq[r], req_to_token)
                out = torch.where(rows, self._attend_lists(q, k_buf, v_buf, torch.zeros_like(lens), windows, whole, r,
                                                          scale), out)
            return out
        direct = (self.direct[r], self.rows[r], self.seq[r], req_to_token, self.tail_from[r])
        return self._attend_lists(q, k_buf, v_buf, lens, windows, direct, r, scale)

    def _attend_lists(self, q, k_buf, v_buf, lens, windows, direct, r: slice, scale: float,
                      tail_ring: int = 0) -> torch.Tensor:
        bs = q.shape[0]
        if self.workspace is None:
            return sparse_decode_attention_ref(q, k_buf, v_buf, self.starts, windows, scale, lens=lens,
                                               direct=direct, list_rows=self.list_rows[r], tail_ring=tail_ring)
        opart, lse = self.workspace
        ws = (opart[:opart.numel() // self.max_bs * bs], lse[:lse.numel() // self.max_bs * bs])
        return sparse_decode_attention(q, k_buf, v_buf, self.starts, windows, scale, num_splits=SPLITS,
                                       workspace=ws, lens=lens, direct=direct, list_rows=self.list_rows[r],
                                       tail_ring=tail_ring)


def check_table(table, bs: int, cap, scratch_rows: int, req_to_token_shape) -> None:
    """Debug mode: every batch row's segments lie inside the pools and its scratch rows inside the scratch, its
    request row and length inside req_to_token; scratch rows of two batch rows never overlap."""
    steps = [StepRow(r, *extra) for r, extra in zip(batch_ranges(table, bs), table[NR:, :bs].T.tolist())]
    end = 0
    for i, step in enumerate(steps):
        r = step.ranges
        for seg in (r.prefix, r.own):
            assert (seg.coarse_at + seg.coarse <= cap.coarse and seg.fine_at + seg.fine <= cap.fine
                    and seg.chunk_at + seg.chunks <= cap.chunks), (i, step)
        assert r.fines == 0 or r.scratch_at >= end, ("overlapping scratch rows", i)
        end = max(end, r.scratch_at + r.fines)
        assert end <= scratch_rows, ("scratch rows", i)
        assert 0 <= step.row < req_to_token_shape[0] and 0 < step.seq <= req_to_token_shape[1], (i, step)
        assert step.fresh or not r.prefix.chunks + r.own.chunks, ("a row with an index that does not select", i)
