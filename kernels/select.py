"""Batched lychee selection on the GPU: coarse expansion, fine-cluster pick and token-list emission.

No host synchronization and static launch shapes, so it runs inside a CUDA graph. The index of every
request lives in the node pools of ``sgl_sparsekv.index_pool`` (one row per node, KV heads side by
side); request ``b`` of the batch owns rows ``[off[b], off[b] + count[b])`` of each pool:

    coarse pool:  mu [C, H, d], r [C, H], tok [C, H]                 (co, P per request)
    fine pool:    mu [F, H, d], r [F, H], tok [F, H], parent [F, H]  (fo, L; parent is a local coarse index)
    chunk pool:   fine [K, H] (local fine index), start [K], length [K] (positions)   (ko, M)

``select_fine`` follows sgl_sparsekv/select.py exactly, ties included: coarse units are expanded in
bound order while the tokens before them stay under ``expand * budget``; the expanded units' fine
clusters are taken in bound order while the running token count stays within the budget. Both cuts
are computed by counting, for each node, the tokens of the nodes ranked before it (pairwise, ties by
lower index, as a stable sort would), so no sort and no host step is needed. Fine clusters are stored
grouped by parent (``build_index`` orders them so), which makes the live set of a step a few
contiguous runs: blocks without a live cluster are skipped.

``emit_tokens`` then writes each (request, KV head)'s KV slots: the sink, the selected chunks' tokens
outside the recent window, and the recent window, into a fixed window of ``cap`` entries. Requests
whose length is within ``dense_limit`` get all their tokens (they decode densely, like the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(float("-inf"))


@triton.jit
def _group_query(Q, pid, stride_qb, stride_qh, H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(request, KV head) of a program and that GQA group's queries [BLOCK_G, BLOCK_D] in fp32."""
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < G)[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    return b, h, q


@triton.jit
def _bounds(q, mu, r, G: tl.constexpr, BLOCK_G: tl.constexpr):
    """Upper bound of each node for the group: max over its query heads of q.mu + |q| r."""
    qn = tl.sqrt(tl.sum(q * q, 1))
    s = tl.dot(q, tl.trans(mu.to(tl.float32)), input_precision="ieee") + qn[:, None] * r[None, :]
    return tl.max(tl.where((tl.arange(0, BLOCK_G) < G)[:, None], s, NEG), 0)


@triton.jit
def _fine_bounds_kernel(Q, CMu, CR, CTok, CFirst, CNum, FMu, FR, FPar, Co, Pn, Fo, Ln, Budget, Scratch, Runs, Bnd,
                        expand, stride_qb, stride_qh, stride_cm, stride_fm,
                        H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h, q = _group_query(Q, pid, stride_qb, stride_qh, H, G, BLOCK_G, D, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    budget = tl.load(Budget + b).to(tl.float32)
    co = tl.load(Co + b).to(tl.int64)
    P = tl.load(Pn + b)
    fo = tl.load(Fo + b).to(tl.int64)
    L = tl.load(Ln + b)

    # coarse expansion (P <= BLOCK_P), recomputed by every part: tokens of the units ranked before each
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < P
    mu = tl.load(CMu + (co + offs_p)[:, None] * stride_cm + h * D + offs_d[None, :],
                 mask=pmask[:, None] & dmask[None, :], other=0.0)
    r = tl.load(CR + (co + offs_p) * H + h, mask=pmask, other=NEG)
    tok = tl.load(CTok + (co + offs_p) * H + h, mask=pmask, other=0.0)
    ub = tl.where(pmask & (r > NEG), _bounds(q, mu, r, G, BLOCK_G), NEG)
    before = (ub[None, :] > ub[:, None]) | ((ub[None, :] == ub[:, None]) & (offs_p[None, :] < offs_p[:, None]))
    tok_before = tl.sum(tl.where(before, tok[None, :], 0.0), 1)
    expanded = (tok_before < expand * budget) & (ub > NEG)
    scratch = Scratch + (pid * PARTS + part) * BLOCK_P
    tl.store(scratch + offs_p, expanded.to(tl.int32))
    tl.debug_barrier()
    if part == 0:
        # children of consecutive expanded units are one run of rows: the cut kernel walks only these runs
        prev = tl.load(scratch + offs_p - 1, mask=pmask & (offs_p > 0), other=0) > 0
        nxt = tl.load(scratch + offs_p + 1, mask=(offs_p + 1) < P, other=0) > 0
        is_start = expanded & ~prev
        is_end = expanded & ~nxt
        first = tl.load(CFirst + (co + offs_p) * H + h, mask=pmask, other=0)
        num = tl.load(CNum + (co + offs_p) * H + h, mask=pmask, other=0)
        runs = Runs + pid * (2 * BLOCK_P + 1)
        tl.store(runs + 1 + tl.cumsum(is_start.to(tl.int32), 0) - 1, first, mask=is_start)
        tl.store(runs + 1 + BLOCK_P + tl.cumsum(is_end.to(tl.int32), 0) - 1, first + num, mask=is_end)
        tl.store(runs, tl.sum(is_start.to(tl.int32), 0))

    for blk in range(part * BLOCK_L, L, PARTS * BLOCK_L):
        offs_l = blk + tl.arange(0, BLOCK_L)
        lmask = offs_l < L
        par = tl.load(FPar + (fo + offs_l) * H + h, mask=lmask, other=0)
        fr = tl.load(FR + (fo + offs_l) * H + h, mask=lmask, other=NEG)
        live = (tl.load(scratch + par, mask=lmask, other=0) > 0) & lmask & (fr > NEG)
        fub = tl.full([BLOCK_L], NEG, tl.float32)
        if tl.max(live.to(tl.int32), 0) > 0:
            fmu = tl.load(FMu + (fo + offs_l)[:, None] * stride_fm + h * D + offs_d[None, :],
                          mask=live[:, None] & dmask[None, :], other=0.0)
            fub = tl.where(live, _bounds(q, fmu, fr, G, BLOCK_G), NEG)
        tl.store(Bnd + (fo + offs_l) * H + h, fub, mask=lmask)


@triton.jit
def _cut_kernel(Bnd, FTok, Fo, Ln, Budget, Runs, Sel, H: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b = pid // H
    h = pid % H
    budget = tl.load(Budget + b).to(tl.float32)
    fo = tl.load(Fo + b).to(tl.int64)
    L = tl.load(Ln + b)
    runs = Runs + pid * (2 * BLOCK_P + 1)
    n_runs = tl.load(runs)
    for iblk in range(part * BLOCK_I, L, PARTS * BLOCK_I):
        offs_i = iblk + tl.arange(0, BLOCK_I)
        imask = offs_i < L
        ub_i = tl.load(Bnd + (fo + offs_i) * H + h, mask=imask, other=NEG)
        tok_i = tl.load(FTok + (fo + offs_i) * H + h, mask=imask, other=0.0)
        acc = tl.zeros([BLOCK_I], tl.float32)
        if tl.max(ub_i, 0) > NEG:
            # only live clusters can rank before a live one: walk the runs of the expanded units' children
            for r in range(0, n_runs):
                lo = tl.load(runs + 1 + r)
                hi = tl.load(runs + 1 + BLOCK_P + r)
                for jblk in range(lo, hi, BLOCK_J):
                    offs_j = jblk + tl.arange(0, BLOCK_J)
                    jmask = offs_j < hi
                    ub_j = tl.load(Bnd + (fo + offs_j) * H + h, mask=jmask, other=NEG)
                    tok_j = tl.load(FTok + (fo + offs_j) * H + h, mask=jmask, other=0.0)
                    before = (ub_j[None, :] > ub_i[:, None]) | (
                        (ub_j[None, :] == ub_i[:, None]) & (offs_j[None, :] < offs_i[:, None]))
                    before = before & (ub_j > NEG)[None, :]
                    acc += tl.sum(tl.where(before, tok_j[None, :], 0.0), 1)
        take = (ub_i > NEG) & (acc + tok_i <= budget)
        tl.store(Sel + (fo + offs_i) * H + h, take.to(tl.float32), mask=imask)


def select_fine(q, coarse, fine, co, pn, fo, ln, budget, expand: float, max_coarse: int = 64, parts: int = 8,
                out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """-> sel [F, H] float32 (1.0 = take) for the batch's fine rows; other rows are untouched.

    coarse = (mu [C,H,d], r [C,H], tok [C,H], first [C,H], num [C,H]): first/num are the local row range of a
    unit's fine clusters (they are stored grouped by parent, see :func:`coarse_ranges`);
    fine = (mu [F,H,d], r [F,H], tok [F,H], parent [F,H] int32); co/pn/fo/ln/budget: [bs] int32 per batch row. ``out`` = (bounds, sel), both [F, H] float32, and
    ``parts`` programs per (request, KV head) split the clusters.
    """
    bs, Hq, D = q.shape
    cmu, cr, ctok, cfirst, cnum = coarse
    fmu, fr, ftok, fpar = fine
    H = cmu.shape[1]
    G = Hq // H
    BLOCK_P = max(16, triton.next_power_of_2(max_coarse))
    bnd, sel = out if out is not None else (torch.empty(fr.shape, dtype=torch.float32, device=q.device),
                                            torch.empty(fr.shape, dtype=torch.float32, device=q.device))
    scratch = torch.empty(bs * H * parts * BLOCK_P, dtype=torch.int32, device=q.device)
    runs = torch.empty(bs * H * (2 * BLOCK_P + 1), dtype=torch.int32, device=q.device)
    _fine_bounds_kernel[(bs * H, parts)](
        q, cmu, cr, ctok, cfirst, cnum, fmu, fr, fpar, co, pn, fo, ln, budget, scratch, runs, bnd, float(expand),
        q.stride(0), q.stride(1), cmu.stride(0), fmu.stride(0),
        H=H, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_P=BLOCK_P, BLOCK_L=32, PARTS=parts)
    _cut_kernel[(bs * H, parts)](bnd, ftok, fo, ln, budget, runs, sel, H=H, BLOCK_P=BLOCK_P, BLOCK_I=64, BLOCK_J=128,
                                 PARTS=parts)
    return sel


@triton.jit
def _emit_request(Fo, Ko, Mn, SeqLen, pid, dense_limit, sink, recent, H: tl.constexpr):
    """A list's request: (b, h, fine offset, chunk offset, chunks to scan, length, sink end, recent start).
    A request within ``dense_limit`` scans no chunk: its sink is the whole sequence."""
    b = pid // H
    h = pid % H
    S = tl.load(SeqLen + b)
    dense = S <= dense_limit
    n_sink = tl.where(dense, S, tl.minimum(sink, S))
    rec_start = tl.where(dense, S, tl.maximum(n_sink, S - recent))
    M = tl.where(dense, 0, tl.load(Mn + b))
    return b, h, tl.load(Fo + b).to(tl.int64), tl.load(Ko + b).to(tl.int64), M, S, n_sink, rec_start


@triton.jit
def _chunk_counts(Sel, CFine, CStart, CLen, fo, ko, offs, mm, h, n_sink, rec_start, H: tl.constexpr):
    cf = tl.load(CFine + (ko + offs) * H + h, mask=mm, other=0)
    take = (tl.load(Sel + (fo + cf) * H + h, mask=mm, other=0.0) > 0) & mm
    st = tl.load(CStart + ko + offs, mask=mm, other=0)
    ln = tl.load(CLen + ko + offs, mask=mm, other=0)
    en = tl.minimum(st + ln, rec_start)
    st = tl.maximum(st, n_sink)
    return st, tl.where(take, tl.maximum(en - st, 0), 0)


@triton.jit
def _emit_count_kernel(Sel, CFine, CStart, CLen, Fo, Ko, Mn, SeqLen, Counts, dense_limit, sink, recent,
                       H: tl.constexpr, BLOCK_M: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h, fo, ko, M, S, n_sink, rec_start = _emit_request(Fo, Ko, Mn, SeqLen, pid, dense_limit, sink, recent, H)
    total = 0
    for blk in range(part * BLOCK_M, M, PARTS * BLOCK_M):
        offs = blk + tl.arange(0, BLOCK_M)
        st, cnt = _chunk_counts(Sel, CFine, CStart, CLen, fo, ko, offs, offs < M, h, n_sink, rec_start, H)
        total += tl.sum(cnt, 0)
    tl.store(Counts + pid * PARTS + part, total)


@triton.jit
def _emit_write_kernel(Sel, CFine, CStart, CLen, Fo, Ko, Mn, Rows, SeqLen, ReqToToken, Counts, Out, Lens,
                       stride_rt, dense_limit, sink, recent, H: tl.constexpr, CAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, MAXLEN: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h, fo, ko, M, S, n_sink, rec_start = _emit_request(Fo, Ko, Mn, SeqLen, pid, dense_limit, sink, recent, H)
    row = tl.load(Rows + b).to(tl.int64)
    offs_parts = tl.arange(0, PARTS)
    counts = tl.load(Counts + pid * PARTS + offs_parts)
    n = n_sink + tl.sum(tl.where(offs_parts < part, counts, 0), 0)
    n_chunks = tl.sum(counts, 0)
    base = pid * CAP
    src = ReqToToken + row * stride_rt
    for blk in range(part * BLOCK_M, M, PARTS * BLOCK_M):
        offs = blk + tl.arange(0, BLOCK_M)
        st, cnt = _chunk_counts(Sel, CFine, CStart, CLen, fo, ko, offs, offs < M, h, n_sink, rec_start, H)
        dst = n + tl.cumsum(cnt, 0) - cnt
        k = tl.arange(0, MAXLEN)
        m2 = (k[None, :] < cnt[:, None]) & ((dst[:, None] + k[None, :]) < CAP)
        slot = tl.load(src + st[:, None] + k[None, :], mask=m2, other=0)
        tl.store(Out + base + dst[:, None] + k[None, :], slot, mask=m2)
        n += tl.sum(cnt, 0)
    if part == 0:
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
        tl.store(Lens + pid, tl.minimum(n_tail + S - rec_start, CAP))


def emit_tokens(sel, chunks, fo, ko, mn, rows, seq_lens, req_to_token, sink: int, recent: int, cap: int,
                dense_limit: int = 0, max_chunk: int = 16, parts: int = 8, out=None):
    """-> (lens [bs*H] int32, windows [bs*H*cap] int32): list ``i`` is ``windows[i*cap : i*cap + lens[i]]``.

    chunks = (fine [K,H] int32 local fine index, start [K] int32, length [K] int32 <= max_chunk); rows: request
    pool rows. Each list holds at most ``cap`` slots (sized by the caller from the budget). A request with at
    most ``dense_limit`` tokens gets all of them. ``out`` = (lens, windows, counts [bs*H*parts] int32).
    """
    cfine, cstart, clen = chunks
    bs, H = rows.shape[0], sel.shape[1]
    if out is None:
        out = (torch.empty(bs * H, dtype=torch.int32, device=sel.device),
               torch.empty(bs * H * cap, dtype=torch.int32, device=sel.device),
               torch.empty(bs * H * parts, dtype=torch.int32, device=sel.device))
    lens, windows, counts = out
    _emit_count_kernel[(bs * H, parts)](sel, cfine, cstart, clen, fo, ko, mn, seq_lens, counts, dense_limit, sink,
                                        recent, H=H, BLOCK_M=64, PARTS=parts)
    _emit_write_kernel[(bs * H, parts)](sel, cfine, cstart, clen, fo, ko, mn, rows, seq_lens, req_to_token, counts,
                                        windows, lens, req_to_token.stride(0), dense_limit, sink, recent, H=H,
                                        CAP=cap, BLOCK_M=64, BLOCK_T=64, MAXLEN=triton.next_power_of_2(max_chunk),
                                        PARTS=parts)
    return lens, windows


def coarse_ranges(fine_parent: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fine_parent [H, L] sorted per head -> (first [H, P], num [H, P]) int32: each unit's children rows."""
    units = torch.arange(P, device=fine_parent.device).expand(fine_parent.shape[0], -1).contiguous()
    parent = fine_parent.contiguous()
    lo = torch.searchsorted(parent, units)
    hi = torch.searchsorted(parent, units, right=True)
    return lo.to(torch.int32), (hi - lo).to(torch.int32)


def pack(indexes, chunk_starts, chunk_lens, device):
    """Host-side packing of per-request ClusterIndex objects into node pools (tests and benchmarks).

    Returns (coarse, fine, chunks, (co, pn, fo, ln, ko, mn)) in the layouts the kernels read.
    """
    def cat(ts):
        return torch.cat(ts).to(device)

    co, pn, fo, ln, ko, mn = [], [], [], [], [], []
    c = f = k = 0
    for ix, st in zip(indexes, chunk_starts):
        P, L, M = ix.coarse_r.shape[1], ix.fine_r.shape[1], ix.chunk_fine.shape[1]
        co.append(c); pn.append(P); fo.append(f); ln.append(L); ko.append(k); mn.append(M)
        c, f, k = c + P, f + L, k + M
    ranges_ = [coarse_ranges(ix.fine_parent, ix.coarse_r.shape[1]) for ix in indexes]
    coarse = (cat([ix.coarse_mu.transpose(0, 1) for ix in indexes]).contiguous(),
              cat([ix.coarse_r.T for ix in indexes]).contiguous(),
              cat([ix.coarse_tokens.T for ix in indexes]).contiguous(),
              cat([f.T for f, _ in ranges_]).contiguous(), cat([n.T for _, n in ranges_]).contiguous())
    fine = (cat([ix.fine_mu.transpose(0, 1) for ix in indexes]).contiguous(),
            cat([ix.fine_r.T for ix in indexes]).contiguous(),
            cat([ix.fine_tokens.T for ix in indexes]).contiguous(),
            cat([ix.fine_parent.T for ix in indexes]).to(torch.int32).contiguous())
    chunks = (cat([ix.chunk_fine.T for ix in indexes]).to(torch.int32).contiguous(),
              cat(list(chunk_starts)).to(torch.int32), cat(list(chunk_lens)).to(torch.int32))
    ranges = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (co, pn, fo, ln, ko, mn))
    return coarse, fine, chunks, ranges
