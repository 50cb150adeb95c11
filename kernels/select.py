"""Batched lychee selection on the GPU: coarse expansion, fine-cluster pick and token-list emission.

No host synchronization and static launch shapes, so it runs inside a CUDA graph. The index of every
request lives in the node pools of ``sgl_sparsekv.index_pool`` (one row per node, KV heads side by
side):

    coarse pool:  (mu [C, H, d], scale [C, H]), r [C, H], tok [C, H]                 (co, P per segment)
    fine pool:    (mu [F, H, d], scale [F, H]), r [F, H], tok [F, H], parent [F, H]  (fo, L; parent: local coarse)
    fine boxes:   [F, H, 2, d] bf16: center and half-width                           (optional, ``fine_bound`` "box")
    (a centroid is its int8 codes ``mu`` times its power-of-two ``scale``, ``sgl_sparsekv.index.quantize``)
    chunk pool:   fine [K, H] (local fine index), start [K], length [K] (positions)   (ko, M)

A request's index is two segments of rows, read as one index: segment 0, adopted from a cached prefix and
shared read-only by every request that adopted it, then segment 1, the request's own (the chunks past the
prefix and the chunks grafted at decode). ``ranges`` (``RequestRanges``, one column per batch row) gives per
batch row each segment's first row and count at each level and ``scratch_at``, the request's rows in the step's scratch (bounds and picks
of its ``prefix.fine + own.fine`` fine clusters: a shared segment's rows are read by many requests of a batch,
so nothing per request is written to them). In the union, segment 1's local indexes follow segment 0's:
its fine parents count from ``prefix.coarse``, its chunks' clusters from ``prefix.fine``. A request without an adopted prefix
has an empty segment 0.

``select_fine`` follows sgl_sparsekv/select.py exactly on that union, ties included: coarse units are
expanded in bound order while the tokens before them stay under ``expand * budget`` (counted pairwise,
ties by lower index, as a stable sort would); the expanded units' fine clusters are taken in bound order
while the running token count stays within the budget. That second cut is found without sorting, in one
program per (request, KV head): a bisection over order-preserving integer keys of the bounds finds the
bound of the first cluster that overflows, in at most 33 passes over registers (the last ones over the few
clusters near the cut; over the live clusters only where the coarse expansion left few of many), so its cost grows
with the clusters, not with their square.

``emit_tokens`` then writes each (request, KV head)'s KV slots: the sink, the selected chunks' tokens
outside the recent window, and the recent window, into a fixed window of ``cap`` entries. Requests
whose length is within ``dense_limit`` get all their tokens (they decode densely, like the reference).

Every kernel runs over (request, retrieval KV head) pairs: ``heads`` lists the KV heads that select their own
tokens in this layer (all by default). With hybrid heads (``sgl_sparsekv.head_roles``) the other heads' rows of
``sel`` and their token lists are left untouched, so a sparse head keeps the list of the layer before.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(float("-inf"))
# a (request, KV head) with at most CUT_BLOCK fine clusters (~196K tokens at 12-token chunks, one per cluster) is
# cut in registers, by CUT_WARPS warps. Timed on an H200 (batch 16, per layer): 8192 and 8 warps, as up to c436d85,
# took 17 us at 2.7K clusters, 37 us at 4.2K and 167-185 us at 8.3K-10.6K (past the block: passes over memory);
# 16384 and 16 warps take 18, 28 and 67 us. 8 warps, on an H100: 1.4 us faster at 32K, 1.6-1.9 us slower at 126K, the
# layer's chain slower at both (bench/results/selection_breakdown_cut_warps_h100.json)
CUT_BLOCK, CUT_WARPS = 16384, 16
# the register cut's last passes run on the clusters whose bounds lie within CUT_BAND_KEYS float steps of the cut
# (2^16: 1/128 of a binade), gathered into a tile of CUT_BAND when they are that few: on an H200 at 32K this took
# the cut from 18.8 to 16.7 us per layer at batch 1 (19.6 to 17.2 at batch 16; bands of 64 and 128: 17.4, 17.7)
CUT_BAND, CUT_BAND_KEYS = 32, 1 << 16
# the register cut's first passes (up to CUT_VALUE_STEPS) split the bounds' value interval rather than their key
# interval: keys span about 2^31 whenever bounds of both signs are live, so key bisection takes ~16 passes to reach
# the band, value bisection 8-9 (random and clustered keys, 340-10.6K clusters); a threshold near zero, where keys
# crowd, still ends in key passes
CUT_VALUE_STEPS = 12
# rows per tile of emission's chunk scan: a launch-parameter sweep on an H100 at 32K (batch 1 and 16, 32 programs per
# list) took 26 -> 17 us per layer at batch 16
EMIT_BLOCK = 128
# (rows per tile, warps) of the fine bounds, by whether a tile is scored on the tensor cores (bf16 queries) or by
# FMAs. The FMA kernel's 32 rows, timed on an H200 with coarse_expand 32, took 69 -> 57 us at batch 16 and 32K against
# 16. Swept on an H100 with one chunk per fine cluster (bench/results/fine_bounds_eager_h100.json), the tensor-core
# kernel takes 0.043 -> 0.025 ms at batch 16 and 32K with 64 rows and 2 warps instead of 32 and 4 (126K: 0.086 ->
# 0.037; batch 1 at 32K: 0.0054 -> 0.0044 with 64 programs per list)
FINE_TILE = {True: (64, 2), False: (32, 4)}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class Segment(NamedTuple):
    """A request's rows of one segment of the index pools: the first row and the row count at each level."""

    coarse_at: int = 0
    coarse: int = 0
    fine_at: int = 0
    fine: int = 0
    chunk_at: int = 0
    chunks: int = 0


class RequestRanges(NamedTuple):
    """One batch row of the step table ``ranges`` [len(RANGE_FIELDS), bs] int32 that every selection kernel reads:
    segment 0 (``prefix``: adopted from a cached prefix, shared read-only), segment 1 (``own``: the chunks past the
    prefix and the grafted ones) and the request's first column in the step's scratch (``scratch_at``)."""

    prefix: Segment
    own: Segment
    scratch_at: int

    def column(self) -> list[int]:
        return [*self.prefix, *self.own, self.scratch_at]

    @classmethod
    def of(cls, column) -> "RequestRanges":
        n = len(Segment._fields)
        return cls(Segment(*column[:n]), Segment(*column[n:2 * n]), column[2 * n])

    @property
    def fines(self) -> int:
        """Fine clusters of the union: the request's scratch columns."""
        return self.prefix.fine + self.own.fine


class Centroids(NamedTuple):
    """Stored centroids: int8 ``codes`` [N, H, d] times a power-of-two ``scale`` [N, H] (``index.quantize``)."""

    codes: torch.Tensor
    scale: torch.Tensor


class CoarseRows(NamedTuple):
    """A sparse layer's coarse pool as the kernels read it: per row and KV head."""

    centroids: Centroids
    radius: torch.Tensor   # [C, H] fp32; -inf: an empty row
    tokens: torch.Tensor   # [C, H] fp32


class FineRows(NamedTuple):
    """A sparse layer's fine pool: as the coarse, plus each cluster's coarse unit (local to its segment)."""

    centroids: Centroids
    radius: torch.Tensor   # [F, H]
    tokens: torch.Tensor   # [F, H]
    parent: torch.Tensor   # [F, H] int32


class ChunkRows(NamedTuple):
    """A sparse layer's chunk pool: each chunk's fine cluster (local to its segment), first position and length."""

    fine: torch.Tensor     # [K, H] int32
    start: torch.Tensor    # [K] int32
    length: torch.Tensor   # [K] int32


RANGE_FIELDS = (*(f"prefix_{f}" for f in Segment._fields), *(f"own_{f}" for f in Segment._fields), "scratch_at")
# the kernels' row indexes of those fields (a Triton kernel reads module constants only as constexpr)
(PREFIX_COARSE_AT, PREFIX_COARSE, PREFIX_FINE_AT, PREFIX_FINE, PREFIX_CHUNK_AT, PREFIX_CHUNKS,
 OWN_COARSE_AT, OWN_COARSE, OWN_FINE_AT, OWN_FINE, OWN_CHUNK_AT, OWN_CHUNKS, SCRATCH_AT) = (
    tl.constexpr(i) for i in range(len(RANGE_FIELDS)))


@triton.jit
def _program_head(pid, Heads, R):
    """A program's (request, KV head): programs run over (request, retrieval head) pairs, the heads of the layer
    that select their own tokens (all of them unless hybrid heads are on)."""
    return pid // R, tl.load(Heads + pid % R).to(tl.int64)


@triton.jit
def _field(T, st, b, k: tl.constexpr):
    """Row ``k`` of the step table (RANGE_FIELDS) for batch row ``b``: a count (int32; loops and masks stay 32-bit)."""
    return tl.load(T + k * st + b)


@triton.jit
def _offset(T, st, b, k: tl.constexpr):
    """Row ``k`` of the step table (RANGE_FIELDS) for batch row ``b``: a row offset (int64, for addresses)."""
    return tl.load(T + k * st + b).to(tl.int64)


@triton.jit
def _union_rows(offs, off0, n0, off1):
    """Pool rows of union positions ``offs``: segment 0's ``n0`` rows from ``off0``, then segment 1's from ``off1``."""
    return tl.where(offs < n0, off0 + offs, off1 + (offs - n0))


@triton.jit
def _bounds(Qg, stride_qh, mu, r, rw, offs_d, dmask, G: tl.constexpr):
    """Ranking score of each node for a GQA group: max over its query heads of q.mu + rw |q| r (rw = 1: the upper
    bound), in fp32 FMAs (no tensor-core tile padding a group of 4 heads to 16 rows). Qg: the group's first query
    head. Callers mask empty nodes (r = -inf), where rw = 0 gives NaN."""
    mu = mu.to(tl.float32)
    best = tl.zeros_like(r) + NEG
    for g in tl.static_range(G):
        q = tl.load(Qg + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(mu * q[None, :], 1) + tl.sqrt(tl.sum(q * q, 0)) * rw * r)
    return best


@triton.jit
def _group_queries(Qg, stride_qh, rw, offs_d, dmask, G: tl.constexpr, BLOCK_G: tl.constexpr):
    """A GQA group's queries as a tile [BLOCK_G, D] in their own dtype (rows past G zero), and ``rw |q|`` per row in
    fp32: what ``_tile_bounds`` scores a tile of centroids with."""
    offs_g = tl.arange(0, BLOCK_G)
    q = tl.load(Qg + offs_g[:, None] * stride_qh + offs_d[None, :], mask=(offs_g < G)[:, None] & dmask[None, :],
                other=0.0)
    qf = q.to(tl.float32)
    return q, tl.sqrt(tl.sum(qf * qf, 1)) * rw


@triton.jit
def _tile_bounds(mu, scale, r, q, qn, G: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr):
    """``_bounds`` of a tile of centroids (int8 codes [rows, D] times ``scale`` [rows]) against bf16 queries, on the
    tensor cores: codes are exact in bf16, bf16 products exact in fp32 and a power-of-two scale exact, so the bounds
    differ from the FMA path only in summation order. IEEE: the same products in fp32 operands (the interpreter
    computes bf16 dots wrongly). r must be finite (callers mask empty nodes)."""
    if IEEE:
        s = tl.dot(mu.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(mu.to(tl.bfloat16), tl.trans(q))
    s = s * scale[:, None] + qn[None, :] * r[:, None]
    return tl.max(tl.where((tl.arange(0, BLOCK_G) < G)[None, :], s, NEG), 1)


@triton.jit
def _box_bounds(Qg, stride_qh, c, w, rw, offs_d, dmask, G: tl.constexpr):
    """Box score of each fine cluster for a GQA group: max over its query heads of q.c + rw |q|.w (rw = 1: Quest's
    bound over the box), in fp32 FMAs. c, w: [rows, D] fp32 center and half-width."""
    best = tl.full([c.shape[0]], NEG, tl.float32)
    for g in tl.static_range(G):
        q = tl.load(Qg + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(c * q[None, :], 1) + rw * tl.sum(w * tl.abs(q)[None, :], 1))
    return best


@triton.jit
def _tile_box_bounds(c, w, q, rw, G: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr):
    """``_box_bounds`` of a tile of bf16 boxes (center, half-width [rows, D]) on the tensor cores: bf16 products
    are exact in fp32, as in ``_tile_bounds``."""
    qa = tl.abs(q)
    if IEEE:
        s = tl.dot(c.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
        s += rw * tl.dot(w.to(tl.float32), tl.trans(qa.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(c, tl.trans(q)) + rw * tl.dot(w, tl.trans(qa))
    return tl.max(tl.where((tl.arange(0, BLOCK_G) < G)[None, :], s, NEG), 1)


@triton.jit
def _coarse_expand_kernel(Q, CMu, CSc, CR, CTok, T, st, Budget, Expanded, Heads, R, expand, rw, stride_qb, stride_qh,
                          stride_cm,
                          H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_P: tl.constexpr):
    """Per (request, retrieval KV head): which coarse units of the union are expanded (P0 + P1 <= BLOCK_P), by
    counting for each unit the tokens of the units ranked before it."""
    pid = tl.program_id(0).to(tl.int64)
    b, h = _program_head(pid, Heads, R)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    budget = tl.load(Budget + b).to(tl.float32)
    P0 = _field(T, st, b, PREFIX_COARSE)
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < P0 + _field(T, st, b, OWN_COARSE)
    crow = _union_rows(offs_p, _offset(T, st, b, PREFIX_COARSE_AT), P0, _offset(T, st, b, OWN_COARSE_AT))
    mu = tl.load(CMu + crow[:, None] * stride_cm + h * D + offs_d[None, :], mask=pmask[:, None] & dmask[None, :],
                 other=0).to(tl.float32) * tl.load(CSc + crow * H + h, mask=pmask, other=0.0)[:, None]
    r = tl.load(CR + crow * H + h, mask=pmask, other=NEG)
    tok = tl.load(CTok + crow * H + h, mask=pmask, other=0.0)
    ub = tl.where(pmask & (r > NEG), _bounds(Q + b * stride_qb + h * G * stride_qh, stride_qh, mu, r, rw,
                                             offs_d, dmask, G), NEG)
    before = (ub[None, :] > ub[:, None]) | ((ub[None, :] == ub[:, None]) & (offs_p[None, :] < offs_p[:, None]))
    tok_before = tl.sum(tl.where(before, tok[None, :], 0.0), 1)
    expanded = (tok_before < expand * budget) & (ub > NEG)
    tl.store(Expanded + pid * BLOCK_P + offs_p, expanded.to(tl.int8))


@triton.jit
def _fine_bounds_kernel(Q, FMu, FSc, FR, FPar, FBox, T, st, Expanded, Bnd, S, Heads, R, rw, stride_qb,
                        stride_qh, stride_fm,
                        H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, PARTS: tl.constexpr,
                        DOT: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr, BOX: tl.constexpr):
    """Bounds of the fine clusters whose coarse unit is expanded (-inf for the others), into the request's scratch
    rows (``Bnd`` [H, S]); PARTS programs per (request, retrieval KV head) split the clusters. DOT (bf16 queries):
    each tile is scored with ``tl.dot`` against the group's queries, loaded once. BOX: clusters are scored by
    their boxes (FBox [F, H, 2, D] bf16) instead of centroid and radius."""
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h = _program_head(pid, Heads, R)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    fo0, L0, fo1 = _offset(T, st, b, PREFIX_FINE_AT), _field(T, st, b, PREFIX_FINE), _offset(T, st, b, OWN_FINE_AT)
    P0 = _field(T, st, b, PREFIX_COARSE)
    L = L0 + _field(T, st, b, OWN_FINE)
    Qg = Q + b * stride_qb + h * G * stride_qh
    if DOT:
        qg, qn = _group_queries(Qg, stride_qh, rw, offs_d, dmask, G, BLOCK_G)
    out = Bnd + h * S + _offset(T, st, b, SCRATCH_AT)
    for blk in range(part * BLOCK_L, L, PARTS * BLOCK_L):
        offs_l = blk + tl.arange(0, BLOCK_L)
        lmask = offs_l < L
        frow = _union_rows(offs_l, fo0, L0, fo1)
        par = tl.load(FPar + frow * H + h, mask=lmask, other=0) + tl.where(offs_l < L0, 0, P0)
        fr = tl.load(FR + frow * H + h, mask=lmask, other=NEG)
        live = (tl.load(Expanded + pid * BLOCK_P + par, mask=lmask, other=0) > 0) & lmask & (fr > NEG)
        fub = tl.full([BLOCK_L], NEG, tl.float32)
        if BOX:
            if tl.max(live.to(tl.int32), 0) > 0:
                at = FBox + (frow * H + h)[:, None] * 2 * D + offs_d[None, :]
                m2 = live[:, None] & dmask[None, :]
                bc, bw = tl.load(at, mask=m2, other=0.0), tl.load(at + D, mask=m2, other=0.0)
                if DOT:
                    fub = tl.where(live, _tile_box_bounds(bc, bw, qg, rw, G, BLOCK_G, IEEE), NEG)
                else:
                    fub = tl.where(live, _box_bounds(Qg, stride_qh, bc.to(tl.float32), bw.to(tl.float32), rw, offs_d,
                                                     dmask, G), NEG)
        elif tl.max(live.to(tl.int32), 0) > 0:
            fmu = tl.load(FMu + frow[:, None] * stride_fm + h * D + offs_d[None, :],
                          mask=live[:, None] & dmask[None, :], other=0)
            fsc = tl.load(FSc + frow * H + h, mask=live, other=0.0)
            if DOT:
                fub = tl.where(live, _tile_bounds(fmu, fsc, tl.where(live, fr, 0.0), qg, qn, G, BLOCK_G, IEEE), NEG)
            else:
                fub = tl.where(live, _bounds(Qg, stride_qh, fmu.to(tl.float32) * fsc[:, None], fr, rw, offs_d, dmask,
                                             G), NEG)
        tl.store(out + offs_l, fub, mask=lmask)


def fine_bounds(q, fine, ranges, expanded, bnd, heads, radius_weight: float, parts: int, max_coarse: int = 64,
                block_l: int | None = None, num_warps: int | None = None, box=None):
    """Launch ``_fine_bounds_kernel`` for the batch of ``q`` (one row per request) into the scratch ``bnd``, after
    the coarse expansion wrote ``expanded``; ``block_l`` and ``num_warps`` (by default ``FINE_TILE``'s) for
    launch-parameter sweeps. bf16 queries (a bf16 model's, with ``gqa_reduce`` "max") are scored on the tensor
    cores: 0.057 -> 0.045 ms per layer at batch 16 and 32K on an H200 (bench/results/fine_bounds_tiles_h200.json);
    others by fp32 FMAs. ``box``: the fine boxes [F, H, 2, d] that rank the clusters instead
    (``IndexPools.box_layer``; unread without)."""
    bs, Hq, D = q.shape
    (fmu, fsc), fr, _, fpar = fine
    H = fmu.shape[1]
    R = heads.numel()
    dot = q.dtype == torch.bfloat16
    block_l, num_warps = block_l or FINE_TILE[dot][0], num_warps or FINE_TILE[dot][1]
    _fine_bounds_kernel[(bs * R, parts)](q, fmu, fsc, fr, fpar, fmu if box is None else box, ranges, ranges.stride(0),
                                         expanded, bnd, bnd.stride(0), heads, R, float(radius_weight), q.stride(0),
                                         q.stride(1), fmu.stride(0),
                                         H=H, G=Hq // H, D=D, BLOCK_D=triton.next_power_of_2(D),
                                         BLOCK_P=_block_p(max_coarse), BLOCK_L=block_l, PARTS=parts,
                                         DOT=dot, BLOCK_G=max(16, triton.next_power_of_2(Hq // H)),
                                         IEEE=_INTERPRET, BOX=box is not None, num_warps=num_warps)


def _block_p(max_coarse: int) -> int:
    """Coarse units of a union (two segments of at most ``max_coarse`` each), as a power of two."""
    return max(16, triton.next_power_of_2(2 * max_coarse))


@triton.jit
def _order_key(ub):
    """int64 keys that order like the float bounds (-0.0 counts as 0.0, as in a float sort)."""
    bits = (ub + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _bounds_and_tokens(Bh, FTok, offs, m, fo0, L0, fo1, h, H: tl.constexpr):
    """Union clusters ``offs``: their bounds (from the request's scratch row ``Bh``) and tokens (from the pool)."""
    ub = tl.load(Bh + offs, mask=m, other=NEG)
    return ub, tl.load(FTok + _union_rows(offs, fo0, L0, fo1) * H + h, mask=m, other=0.0)


@triton.jit
def _keyed_tile(Bh, FTok, offs, m, fo0, L0, fo1, h, H: tl.constexpr):
    """Union clusters ``offs``: (live, order key, tokens)."""
    ub, tok = _bounds_and_tokens(Bh, FTok, offs, m, fo0, L0, fo1, h, H)
    return ub > NEG, _order_key(ub), tok


@triton.jit
def _bisect_in_memory(lo, hi, stop, Bh, FTok, fo0, L0, fo1, L, h, budget, H: tl.constexpr, BLOCK: tl.constexpr):
    """``_bisect`` over all L clusters, each pass read from memory."""
    while hi - lo > stop:
        mid = lo + (hi - lo) // 2
        over = _mass_from(Bh, FTok, fo0, L0, fo1, L, h, mid, H, BLOCK) > budget
        lo = tl.where(over, mid, lo)
        hi = tl.where(over, hi, mid)
    return lo, hi


@triton.jit
def _mass_from(Bh, FTok, fo0, L0, fo1, L, h, v, H: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens of the live clusters whose key is >= v."""
    total = 0.0
    for blk in range(0, L, BLOCK):
        offs = blk + tl.arange(0, BLOCK)
        ub, tok = _bounds_and_tokens(Bh, FTok, offs, offs < L, fo0, L0, fo1, h, H)
        total += tl.sum(tl.where((ub > NEG) & (_order_key(ub) >= v), tok, 0.0), 0)
    return total


@triton.jit
def _bisect(lo, hi, stop, live, key, tok, past, budget):
    """Narrow [lo, hi) to at most ``stop`` keys, keeping mass(key >= lo) > budget >= mass(key >= hi), where
    mass(v) is ``past`` plus the tokens of the ``live`` clusters in registers whose key is >= v."""
    while hi - lo > stop:
        mid = lo + (hi - lo) // 2
        over = past + tl.sum(tl.where(live & (key >= mid), tok, 0.0), 0) > budget
        lo = tl.where(over, mid, lo)
        hi = tl.where(over, hi, mid)
    return lo, hi


@triton.jit
def _bisect_values(lo, hi, lov, hiv, stop, steps, live, key, tok, past, budget):
    """``_bisect`` for at most ``steps`` passes, each at the key of the midpoint of the values ``lov``/``hiv`` that
    ``lo``/``hi`` stand for (kept strictly inside [lo, hi), so the invariant and the result are the same)."""
    n = 0
    while (hi - lo > stop) & (n < steps):
        midv = (lov + hiv) * 0.5
        mid = tl.minimum(tl.maximum(_order_key(midv), lo + 1), hi - 1)
        over = past + tl.sum(tl.where(live & (key >= mid), tok, 0.0), 0) > budget
        lo, lov = tl.where(over, mid, lo), tl.where(over, midv, lov)
        hi, hiv = tl.where(over, hi, mid), tl.where(over, hiv, midv)
        n += 1
    return lo, hi


@triton.jit
def _band_cut(lo, live, key, tok, past, budget):
    """``_bisect`` to one key, for a band of a few clusters in one pairwise pass: the largest key whose mass
    (``past`` plus the band's tokens keyed at or above it) overflows the budget, else ``lo`` (all fits). Token
    counts are whole numbers, so the sums are exact and the key is the one bisection finds."""
    at_or_above = live[None, :] & (key[None, :] >= key[:, None])
    mass = past + tl.sum(tl.where(at_or_above, tok[None, :], 0.0), 1)
    return tl.max(tl.where(live & (mass > budget), key, lo), 0)


@triton.jit
def _take(live, key, tok, lo, above, budget):
    """The picks of a tile: every live cluster keyed above ``lo``, and those keyed ``lo`` in index order while
    ``above`` (the tokens taken before them) plus their running total stays within the budget; and the tile's
    tokens keyed ``lo``."""
    tie = live & (key == lo)
    run = above + tl.cumsum(tl.where(tie, tok, 0.0), 0)
    return live & ((key > lo) | (tie & (run <= budget))), tl.sum(tl.where(tie, tok, 0.0), 0)


@triton.jit
def _compact_live(Bh, Sh, L, BLOCK: tl.constexpr):
    """Write the union indexes of the live clusters (finite bound), in index order, to ``Sh[0:n]``; return n. The
    clusters of unexpanded coarse units are dead, so past ``coarse_expand * budget`` tokens of context most are."""
    n = 0
    for blk in range(0, L, BLOCK):
        offs = blk + tl.arange(0, BLOCK)
        live = tl.load(Bh + offs, mask=offs < L, other=NEG) > NEG
        tl.store(Sh + n + tl.cumsum(live.to(tl.int32), 0) - 1, offs.to(tl.float32), mask=live)
        n += tl.sum(live.to(tl.int32), 0)
    return n


@triton.jit
def _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, n, h, budget, H: tl.constexpr, BLOCK: tl.constexpr,
                      BAND: tl.constexpr, BAND_KEYS: tl.constexpr, COMPACT: tl.constexpr, VALUE_STEPS: tl.constexpr):
    """The cut of one (request, KV head) with L <= BLOCK clusters, every bound held in registers; COMPACT: of the
    ``n`` <= BLOCK live clusters that ``_compact_live`` listed in ``Sh`` instead (any L). A bisection pass costs the
    work over its tile: once the interval holds at most ``BAND_KEYS`` keys, the few clusters left in it are gathered
    into a ``BAND``-wide tile (through the picks' row, which is written last) for the remaining passes. The first
    passes (up to ``VALUE_STEPS``) halve the bounds' value interval, the rest the key interval."""
    one = tl.arange(0, BLOCK)
    if COMPACT:   # the tile holds the live clusters in index order, so ties still resolve by index
        m = one < n
        idx = tl.load(Sh + one, mask=m, other=0.0).to(tl.int32)
        tl.debug_barrier()   # the list is read before the band overwrites it
    else:
        m = one < L
        idx = one
    ub, tok = _bounds_and_tokens(Bh, FTok, idx, m, fo0, L0, fo1, h, H)
    live = ub > NEG
    key = _order_key(ub)
    lo = tl.min(tl.where(live, key, 1 << 40), 0)
    hi = tl.max(tl.where(live, key, -(1 << 40)), 0) + 1
    total = tl.sum(tl.where(live, tok, 0.0), 0)
    lov, hiv = tl.min(tl.where(live, ub, float("inf")), 0), tl.max(tl.where(live, ub, NEG), 0)
    lo, hi = _bisect_values(lo, hi, lov, hiv, BAND_KEYS, VALUE_STEPS, live, key, tok, 0.0, budget)
    lo, hi = _bisect(lo, hi, BAND_KEYS, live, key, tok, 0.0, budget)
    band = live & (key >= lo) & (key < hi)
    nb = tl.sum(band.to(tl.int32), 0)
    if nb <= BAND:
        past = tl.sum(tl.where(live & (key >= hi), tok, 0.0), 0)
        tl.store(Sh + tl.cumsum(band.to(tl.int32), 0) - 1, idx.to(tl.float32), mask=band)
        tl.debug_barrier()
        j = tl.arange(0, BAND)
        jm = j < nb
        bub, btok = _bounds_and_tokens(Bh, FTok, tl.load(Sh + j, mask=jm, other=0.0).to(tl.int32), jm, fo0, L0, fo1,
                                       h, H)
        lo = _band_cut(lo, jm, _order_key(bub), btok, past, budget)
        tl.debug_barrier()   # the band's indexes are read before the picks overwrite them
    else:   # many clusters share a handful of keys (exact ties): the passes stay on the whole tile
        lo, hi = _bisect(lo, hi, 1, live, key, tok, 0.0, budget)
    lo = tl.where(total <= budget, lo - 1, lo)   # everything fits: every live key lies above lo
    above = tl.sum(tl.where(live & (key > lo), tok, 0.0), 0)
    take, _ = _take(live, key, tok, lo, above, budget)
    if COMPACT:   # every cluster's pick is 0 but the taken ones'
        for blk in range(0, L, BLOCK):
            tl.store(Sh + blk + one, tl.zeros([BLOCK], tl.float32), mask=blk + one < L)
        tl.debug_barrier()
        tl.store(Sh + idx, take.to(tl.float32), mask=take)
    else:
        tl.store(Sh + one, take.to(tl.float32), mask=m)


@triton.jit
def _cut_in_memory(Bh, FTok, Sh, fo0, L0, fo1, L, h, budget, H: tl.constexpr, BLOCK: tl.constexpr,
                   BAND: tl.constexpr, BAND_KEYS: tl.constexpr):
    """The cut of one (request, KV head) with more than BLOCK clusters: every bisection pass reads all of them
    (``_mass_from``), so the passes stop once the interval holds at most ``BAND_KEYS`` keys, and one more pass
    gathers the clusters left in it into a ``BAND``-wide tile for the rest (as ``_cut_in_registers`` does; the
    band is wider here, since each pass it saves reads every cluster). With 8192-wide tiles and 8 warps, at
    100K-126K tokens (batch 16, H200), this took the cut from 167-185 to 122-131 us per layer."""
    one = tl.arange(0, BLOCK)
    lo = tl.full([], 1 << 40, tl.int64)
    hi = tl.full([], -(1 << 40), tl.int64)
    total = 0.0
    for blk in range(0, L, BLOCK):
        offs = blk + one
        live, key, tok = _keyed_tile(Bh, FTok, offs, offs < L, fo0, L0, fo1, h, H)
        lo = tl.minimum(lo, tl.min(tl.where(live, key, 1 << 40), 0))
        hi = tl.maximum(hi, tl.max(tl.where(live, key, -(1 << 40)), 0))
        total += tl.sum(tl.where(live, tok, 0.0), 0)
    hi += 1
    lo, hi = _bisect_in_memory(lo, hi, BAND_KEYS, Bh, FTok, fo0, L0, fo1, L, h, budget, H, BLOCK)
    # the band [lo, hi): its clusters' indexes into the picks row (written last), and the tokens above it
    n = 0
    past = 0.0
    for blk in range(0, L, BLOCK):
        offs = blk + one
        live, key, tok = _keyed_tile(Bh, FTok, offs, offs < L, fo0, L0, fo1, h, H)
        band = live & (key >= lo) & (key < hi)
        at = n + tl.cumsum(band.to(tl.int32), 0) - 1
        tl.store(Sh + at, offs.to(tl.float32), mask=band & (at < BAND))
        n += tl.sum(band.to(tl.int32), 0)
        past += tl.sum(tl.where(live & (key >= hi), tok, 0.0), 0)
    tl.debug_barrier()
    if n <= BAND:
        j = tl.arange(0, BAND)
        jm = j < n
        bub, btok = _bounds_and_tokens(Bh, FTok, tl.load(Sh + j, mask=jm, other=0.0).to(tl.int32), jm, fo0, L0, fo1,
                                       h, H)
        lo, hi = _bisect(lo, hi, 1, jm, _order_key(bub), btok, past, budget)
    else:   # many clusters share a handful of keys (exact ties): the passes stay on all of them
        lo, hi = _bisect_in_memory(lo, hi, 1, Bh, FTok, fo0, L0, fo1, L, h, budget, H, BLOCK)
    tl.debug_barrier()   # the band's indexes are read before the picks overwrite them
    lo = tl.where(total <= budget, lo - 1, lo)   # everything fits: every live key lies above lo
    above = _mass_from(Bh, FTok, fo0, L0, fo1, L, h, lo + 1, H, BLOCK)
    for blk in range(0, L, BLOCK):
        offs = blk + one
        m = offs < L
        live, key, tok = _keyed_tile(Bh, FTok, offs, m, fo0, L0, fo1, h, H)
        take, tied = _take(live, key, tok, lo, above, budget)
        tl.store(Sh + offs, take.to(tl.float32), mask=m)
        above += tied


@triton.jit
def _cut_kernel(Bnd, FTok, T, st, Budget, Sel, S, Heads, R, H: tl.constexpr, BLOCK: tl.constexpr,
                BAND: tl.constexpr, BAND_KEYS: tl.constexpr, VALUE_STEPS: tl.constexpr):
    """Take the live clusters in bound order (ties: lower index first) while the running token count stays
    within the budget, without sorting: the bound of the first cluster that overflows is found by bisection
    over order-preserving integer keys; clusters above it are taken, and tied ones in index order. Each
    program takes the smallest register tile its request fits (BLOCK // 8 or // 4). Past BLOCK // 4 clusters it
    first lists the live ones and cuts those when they fit BLOCK // 4: on an H200 at 126K tokens (10.6K clusters,
    a quarter live) this took the cut from 58 to 25 us per layer at batch 1, 75 to 26 at batch 16
    (bench/results/cut_live_list_h200.json). Else the smallest tile that holds them all (BLOCK // 2 or BLOCK),
    else passes over memory.
    Bounds and picks are the request's scratch rows (``Bnd``, ``Sel`` [H, S])."""
    pid = tl.program_id(0).to(tl.int64)
    b, h = _program_head(pid, Heads, R)
    budget = tl.load(Budget + b).to(tl.float32)
    fo0, L0, fo1 = _offset(T, st, b, PREFIX_FINE_AT), _field(T, st, b, PREFIX_FINE), _offset(T, st, b, OWN_FINE_AT)
    L = L0 + _field(T, st, b, OWN_FINE)
    so = h * S + _offset(T, st, b, SCRATCH_AT)
    Bh, Sh = Bnd + so, Sel + so
    if L <= BLOCK // 8:
        _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, L, h, budget, H, BLOCK // 8,
                          BAND, BAND_KEYS, False, VALUE_STEPS)
    elif L <= BLOCK // 4:
        _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, L, h, budget, H, BLOCK // 4,
                          BAND, BAND_KEYS, False, VALUE_STEPS)
    else:
        n = _compact_live(Bh, Sh, L, BLOCK // 4)
        tl.debug_barrier()
        if n <= BLOCK // 8:
            _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, n, h, budget, H, BLOCK // 8,
                              BAND, BAND_KEYS, True, VALUE_STEPS)
        elif n <= BLOCK // 4:
            _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, n, h, budget, H, BLOCK // 4,
                              BAND, BAND_KEYS, True, VALUE_STEPS)
        elif L <= BLOCK // 2:
            _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, L, h, budget, H, BLOCK // 2,
                              BAND, BAND_KEYS, False, VALUE_STEPS)
        elif L <= BLOCK:
            _cut_in_registers(Bh, FTok, Sh, fo0, L0, fo1, L, L, h, budget, H, BLOCK,
                              BAND, BAND_KEYS, False, VALUE_STEPS)
        else:
            _cut_in_memory(Bh, FTok, Sh, fo0, L0, fo1, L, h, budget, H, BLOCK, BAND * 8, BAND_KEYS)


def all_heads(H: int, device) -> torch.Tensor:
    return torch.arange(H, dtype=torch.int32, device=device)


def scratch(rows: int, H: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds, picks) [H, rows] float32: a step's per-request fine-cluster rows (``so`` in ``ranges``), each head's
    contiguous so that a program's tile of clusters is one contiguous load or store."""
    return tuple(torch.empty(H, rows, dtype=torch.float32, device=device) for _ in range(2))


def coarse_expand(q, coarse, ranges, budget, expand: float, heads: torch.Tensor, radius_weight: float = 1.0,
                  max_coarse: int = 64, out: torch.Tensor | None = None) -> torch.Tensor:
    """-> ``out`` [bs * len(heads) * BLOCK_P] int8: per (request, KV head of ``heads``), which coarse units of its
    union the fine bounds expand (``_coarse_expand_kernel``; the first step of :func:`select_fine`)."""
    bs, Hq, D = q.shape
    (cmu, csc), cr, ctok = coarse
    H, R = cmu.shape[1], heads.numel()
    BLOCK_P = _block_p(max_coarse)
    expanded = torch.empty(bs * R * BLOCK_P, dtype=torch.int8, device=q.device) if out is None else out
    _coarse_expand_kernel[(bs * R,)](q, cmu, csc, cr, ctok, ranges, ranges.stride(0), budget, expanded, heads, R,
                                     float(expand), float(radius_weight), q.stride(0), q.stride(1), cmu.stride(0),
                                     H=H, G=Hq // H, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_P=BLOCK_P)
    return expanded


def select_fine(q, coarse, fine, ranges, budget, expand: float, max_coarse: int = 64, parts: int = 8,
                out: tuple[torch.Tensor, torch.Tensor] | None = None, cut_block: int = CUT_BLOCK,
                radius_weight: float = 1.0, heads: torch.Tensor | None = None,
                cut_band: tuple[int, int] = (CUT_BAND, CUT_BAND_KEYS), cut_value_steps: int = CUT_VALUE_STEPS,
                box=None):
    """-> sel [H, S] float32 scratch (1.0 = take): request ``b``'s fine clusters, in union order, are its columns
    ``so[b] ..``, for the KV heads ``heads`` (int32, default all); other columns and heads are untouched.

    coarse: ``CoarseRows``; fine: ``FineRows`` (``IndexPools.layer``); ranges: [len(RANGE_FIELDS), >= bs] int32; budget: [bs] int32. ``out`` = ``scratch(S, H)``, by default sized
    from ``ranges`` (a host read). ``parts`` programs per (request, KV head) split the clusters' bounds. Requests
    with more than ``cut_block`` fine clusters are cut in passes over memory instead of registers; ``cut_band``
    (tile, keys) sets the register cut's last passes and ``cut_value_steps`` its first (``_cut_in_registers``).
    ``radius_weight`` scales the bound's radius term in the ranking (``select.select_clusters``); ``box``
    [F, H, 2, d] bf16: fine boxes, which rank the fine clusters instead of their centroids. Each segment
    has at most ``max_coarse`` coarse units. Bounds and picks use each head's row of the scratch (so many requests
    of a batch read one shared segment without writing to it).
    """
    ftok = fine.tokens
    H = ftok.shape[1]
    if out is None:
        out = scratch(scratch_rows(ranges, q.shape[0]), H, q.device)
    bnd, sel = out
    assert bnd.stride(0) == sel.stride(0), "bounds and picks in one layout"
    heads = all_heads(H, q.device) if heads is None else heads
    R = heads.numel()
    expanded = coarse_expand(q, coarse, ranges, budget, expand, heads, radius_weight, max_coarse)
    fine_bounds(q, fine, ranges, expanded, bnd, heads, radius_weight, parts, max_coarse, box=box)
    _cut_kernel[(q.shape[0] * R,)](bnd, ftok, ranges, ranges.stride(0), budget, sel, bnd.stride(0), heads, R, H=H,
                                   BLOCK=cut_block, BAND=cut_band[0], BAND_KEYS=cut_band[1],
                                   VALUE_STEPS=cut_value_steps, num_warps=CUT_WARPS)
    return sel


def scratch_rows(ranges: torch.Tensor, bs: int) -> int:
    """Scratch columns the first ``bs`` batch rows of ``ranges`` reach (a host read)."""
    return max(1, max(r.scratch_at + r.fines for r in batch_ranges(ranges, bs))) if bs else 1


@triton.jit
def _emit_request(T, st, SeqLen, Fresh, pid, Heads, R, dense_limit, sink, recent):
    """A list's request: (b, h, chunks to scan, length, sink end, recent start, whether its list is written). A
    request within ``dense_limit`` scans no chunk: its sink is the whole sequence."""
    b, h = _program_head(pid, Heads, R)
    S = tl.load(SeqLen + b)
    fresh = tl.load(Fresh + b) != 0
    dense = S <= dense_limit
    n_sink = tl.where(dense, S, tl.minimum(sink, S))
    rec_start = tl.where(dense, S, tl.maximum(n_sink, S - recent))
    M = tl.where(dense, 0, _field(T, st, b, PREFIX_CHUNKS) + _field(T, st, b, OWN_CHUNKS))
    M = tl.where(fresh, M, 0)
    return b, h, M, S, n_sink, rec_start, fresh


@triton.jit
def _chunk_ranges(T, st, b):
    """A request's chunk segments and scratch row, read once per program: (ko0, M0, ko1, L0, so)."""
    return _offset(T, st, b, PREFIX_CHUNK_AT), _field(T, st, b, PREFIX_CHUNKS), _offset(T, st, b, OWN_CHUNK_AT), _field(T, st, b, PREFIX_FINE), _offset(T, st, b, SCRATCH_AT)


@triton.jit
def _chunk_counts(Sel, stride_sel, CFine, CStart, CLen, ko0, M0, ko1, L0, so, offs, mm, h, n_sink, rec_start,
                  H: tl.constexpr):
    """Per union chunk ``offs``: its first position past the sink and its token count if its cluster is taken."""
    krow = _union_rows(offs, ko0, M0, ko1)
    cf = tl.load(CFine + krow * H + h, mask=mm, other=0) + tl.where(offs < M0, 0, L0)
    take = (tl.load(Sel + h * stride_sel + so + cf, mask=mm, other=0.0) > 0) & mm
    pos = tl.load(CStart + krow, mask=mm, other=0)
    en = tl.minimum(pos + tl.load(CLen + krow, mask=mm, other=0), rec_start)
    pos = tl.maximum(pos, n_sink)
    return pos, tl.where(take, tl.maximum(en - pos, 0), 0)


@triton.jit
def _emit_count_kernel(Sel, stride_sel, CFine, CStart, CLen, T, st, SeqLen, Fresh, Counts, Heads, R, dense_limit, sink,
                       recent, H: tl.constexpr, BLOCK_M: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h, M, S, n_sink, rec_start, _fresh = _emit_request(T, st, SeqLen, Fresh, pid, Heads, R, dense_limit, sink,
                                                          recent)
    ko0, M0, ko1, L0, so = _chunk_ranges(T, st, b)
    total = 0
    for blk in range(part * BLOCK_M, M, PARTS * BLOCK_M):
        offs = blk + tl.arange(0, BLOCK_M)
        _, cnt = _chunk_counts(Sel, stride_sel, CFine, CStart, CLen, ko0, M0, ko1, L0, so, offs, offs < M, h, n_sink,
                               rec_start, H)
        total += tl.sum(cnt, 0)
    tl.store(Counts + pid * PARTS + part, total)


@triton.jit
def _emit_write_kernel(Sel, stride_sel, CFine, CStart, CLen, T, st, Rows, SeqLen, Fresh, ListRows, ReqToToken, Counts,
                       Out, Lens, Heads, R, stride_rt, dense_limit, sink, recent, H: tl.constexpr, CAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, MAXLEN: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h, M, S, n_sink, rec_start, fresh = _emit_request(T, st, SeqLen, Fresh, pid, Heads, R, dense_limit, sink,
                                                         recent)
    row = tl.load(Rows + b).to(tl.int64)
    offs_parts = tl.arange(0, PARTS)
    counts = tl.load(Counts + pid * PARTS + offs_parts)
    n = n_sink + tl.sum(tl.where(offs_parts < part, counts, 0), 0)
    n_chunks = tl.sum(counts, 0)
    # the list's place in Out and Lens (its list row's); a sparse head's place keeps its parent layer's list
    lst = tl.load(ListRows + b).to(tl.int64) * H + h
    base = lst * CAP
    src = ReqToToken + row * stride_rt
    ko0, M0, ko1, L0, so = _chunk_ranges(T, st, b)
    for blk in range(part * BLOCK_M, M, PARTS * BLOCK_M):
        offs = blk + tl.arange(0, BLOCK_M)
        first, cnt = _chunk_counts(Sel, stride_sel, CFine, CStart, CLen, ko0, M0, ko1, L0, so, offs, offs < M, h,
                                   n_sink, rec_start, H)
        dst = n + tl.cumsum(cnt, 0) - cnt
        k = tl.arange(0, MAXLEN)
        m2 = (k[None, :] < cnt[:, None]) & ((dst[:, None] + k[None, :]) < CAP)
        slot = tl.load(src + first[:, None] + k[None, :], mask=m2, other=0)
        tl.store(Out + base + dst[:, None] + k[None, :], slot, mask=m2)
        n += tl.sum(cnt, 0)
    if (part == 0) & fresh:
        for t in range(0, n_sink, BLOCK_T):
            pos = t + tl.arange(0, BLOCK_T)
            m = (pos < n_sink) & (pos < CAP)
            tl.store(Out + base + pos, tl.load(src + pos, mask=m, other=0), mask=m)
        n_tail = n_sink + n_chunks
        for t in range(rec_start, S, BLOCK_T):
            pos = t + tl.arange(0, BLOCK_T)
            dst = n_tail + pos - rec_start
            m = (pos < S) & (dst < CAP)
            tl.store(Out + base + dst, tl.load(src + pos, mask=m, other=0), mask=m)
        tl.store(Lens + lst, tl.minimum(n_tail + S - rec_start, CAP))


def emit_tokens(sel, chunks, ranges, rows, seq_lens, req_to_token, sink: int, recent: int, cap: int,
                dense_limit: int = 0, max_chunk: int = 16, parts: int = 8, out=None, heads: torch.Tensor | None = None,
                lists_at: tuple[torch.Tensor, torch.Tensor] | None = None):
    """-> (lens [n*H] int32, windows [n*H*cap] int32): list ``i`` is ``windows[i*cap : i*cap + lens[i]]``.
    Only the lists of the KV heads ``heads`` (int32, default all) are written; the others keep what they held.
    ``lists_at`` = (list rows [bs] int32, fresh [bs] int32): batch row ``b``'s lists are ``list_rows[b] * H + h``
    and are written only where ``fresh[b]`` is set (a request reusing its lists of an earlier step); default: list
    row ``b``, every row written.

    sel: :func:`select_fine`'s scratch rows; chunks: ``ChunkRows`` (lengths <= max_chunk); ranges as in
    :func:`select_fine`; rows: request pool rows. Each list holds at
    most ``cap`` slots (sized by the caller from the budget). A request with at most ``dense_limit`` tokens gets
    all of them. ``out`` = (lens, windows, counts [bs*H*parts] int32).
    """
    cfine, cstart, clen = chunks
    bs, H = rows.shape[0], sel.shape[0]
    if out is None:
        out = (torch.empty(bs * H, dtype=torch.int32, device=sel.device),
               torch.empty(bs * H * cap, dtype=torch.int32, device=sel.device),
               torch.empty(bs * H * parts, dtype=torch.int32, device=sel.device))
    lens, windows, counts = out
    heads = all_heads(H, sel.device) if heads is None else heads
    list_rows, fresh = every_row_fresh(bs, sel.device) if lists_at is None else lists_at
    R = heads.numel()
    st = ranges.stride(0)
    _emit_count_kernel[(bs * R, parts)](sel, sel.stride(0), cfine, cstart, clen, ranges, st, seq_lens, fresh, counts,
                                        heads, R, dense_limit, sink, recent, H=H, BLOCK_M=EMIT_BLOCK, PARTS=parts)
    _emit_write_kernel[(bs * R, parts)](sel, sel.stride(0), cfine, cstart, clen, ranges, st, rows, seq_lens, fresh,
                                        list_rows, req_to_token, counts, windows, lens, heads, R,
                                        req_to_token.stride(0), dense_limit, sink, recent, H=H, CAP=cap,
                                        BLOCK_M=EMIT_BLOCK, BLOCK_T=64, MAXLEN=triton.next_power_of_2(max_chunk),
                                        PARTS=parts)
    return lens, windows


def every_row_fresh(bs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``emit_tokens``' default ``lists_at``: batch row b writes list row b."""
    return torch.arange(bs, dtype=torch.int32, device=device), torch.ones(bs, dtype=torch.int32, device=device)


def union_rows(r: RequestRanges, level: str) -> torch.Tensor:
    """Pool rows of a request's union (segment 0's, then segment 1's) at ``level``: "coarse", "fine" or "chunk"."""
    at, n = {"coarse": ("coarse_at", "coarse"), "fine": ("fine_at", "fine"), "chunk": ("chunk_at", "chunks")}[level]
    return torch.cat([torch.arange(getattr(s, at), getattr(s, at) + getattr(s, n)) for s in (r.prefix, r.own)])


def batch_ranges(ranges: torch.Tensor, bs: int) -> list[RequestRanges]:
    """The first ``bs`` batch rows of ``ranges`` (one host read)."""
    return [RequestRanges.of(c) for c in ranges[:, :bs].T.tolist()]


def emit_tokens_ref(sel, chunks, ranges, rows, seq_lens, req_to_token, sink: int, recent: int, cap: int,
                    dense_limit: int = 0, max_chunk: int = 16, parts: int = 8, out=None,
                    heads: torch.Tensor | None = None, lists_at: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Torch twin of :func:`emit_tokens`: sink, the selected chunks' tokens outside the recent window, recent."""
    cfine, cstart, clen = chunks
    bs, H = rows.shape[0], sel.shape[0]
    if out is None:
        out = (torch.empty(bs * H, dtype=torch.int32, device=sel.device),
               torch.empty(bs * H * cap, dtype=torch.int32, device=sel.device), None)
    lens, windows = out[0], out[1]
    list_rows, fresh = (t.tolist() for t in (every_row_fresh(bs, "cpu") if lists_at is None else lists_at))
    for b, (r, row, S) in enumerate(zip(batch_ranges(ranges, bs), rows.tolist(), seq_lens.tolist())):
        if not fresh[b]:
            continue
        slots = req_to_token[row, :S]
        k = union_rows(r, "chunk").to(sel.device)
        if S <= dense_limit:   # the whole sequence as its sink, no chunk scanned
            n_sink = rec = S
            k = k[:0]
        else:
            n_sink = min(sink, S)
            rec = max(n_sink, S - recent)
        st = cstart[k].long()
        en = torch.clamp(st + clen[k].long(), max=rec)
        st = torch.clamp(st, min=n_sink)
        cf = cfine[k].long()
        cf[r.prefix.chunks:] += r.prefix.fine
        for h in (range(H) if heads is None else heads.tolist()):
            take = sel[h, r.scratch_at + cf[:, h]] > 0
            mid = [slots[a:e] for a, e in zip(st[take].tolist(), en[take].tolist()) if e > a]
            lst = torch.cat([slots[:n_sink], *mid, slots[rec:S]])[:cap]
            i = list_rows[b] * H + h
            windows[i * cap:i * cap + len(lst)] = lst
            lens[i] = len(lst)
    return lens, windows
