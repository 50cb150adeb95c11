"""Batched lychee selection on the GPU: coarse expansion, fine-cluster pick and token-list emission.

No host synchronization and static launch shapes, so it can sit inside a CUDA graph. The index of
every request lives in shared node pools (one row per node, KV heads side by side); request ``b`` of
the batch owns rows ``[off[b], off[b] + count[b])`` of each pool:

    coarse pool:  mu [C, H, d], r [C, H], tok [C, H]                 (co, P per request)
    fine pool:    mu [F, H, d], r [F, H], tok [F, H], parent [F, H]  (fo, L; parent is a local coarse index)
    chunk pool:   fine [K, H] (local fine index), start [K], length [K] (positions)   (ko, M)

``select_fine`` follows sgl_sparsekv/select.py: coarse units are expanded in bound order while the
tokens before them stay under ``expand * budget``; the expanded units' fine clusters are taken in
bound order while they fit the budget. The kernel finds that prefix by bisection on the bound, so
exact ties at the cut are taken or left together (with real-valued bounds the sets are the same).
``emit_tokens`` then writes each (request, KV head)'s KV slots: the sink, the selected chunks'
tokens outside the recent window, and the recent window, into a fixed window of ``cap`` entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select_fine_kernel(Q, CMu, CR, CTok, FMu, FR, FTok, FPar, Co, Pn, Fo, Ln, Budget, Scratch, Sel,
                        expand, stride_qb, stride_qh, stride_cm, stride_fm,
                        H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr,
                        ITERS: tl.constexpr, ONE_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    qn = tl.sqrt(tl.sum(q * q, 1))
    budget = tl.load(Budget + b).to(tl.float32)
    co = tl.load(Co + b)
    P = tl.load(Pn + b)
    fo = tl.load(Fo + b)
    L = tl.load(Ln + b)

    # coarse bounds and expansion (P <= BLOCK_P): rank by pairwise comparison, ties by index
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < P
    mu = tl.load(CMu + (co + offs_p)[:, None] * stride_cm + h * D + offs_d[None, :],
                 mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    r = tl.load(CR + (co + offs_p) * H + h, mask=pmask, other=float("-inf"))
    tok = tl.load(CTok + (co + offs_p) * H + h, mask=pmask, other=0.0).to(tl.float32)
    ub = tl.max(tl.where(gmask[:, None], tl.dot(q, tl.trans(mu)) + qn[:, None] * r[None, :], float("-inf")), 0)
    ub = tl.where(pmask & (r > float("-inf")), ub, float("-inf"))
    ub_i = ub[:, None]
    ub_j = ub[None, :]
    before = (ub_j > ub_i) | ((ub_j == ub_i) & (offs_p[None, :] < offs_p[:, None]))
    tok_before = tl.sum(tl.where(before, tok[None, :], 0.0), 1)
    expanded = (tok_before < expand * budget) & (ub > float("-inf"))
    tl.store(Scratch + pid * BLOCK_P + offs_p, expanded.to(tl.int32))
    tl.debug_barrier()

    # fine bounds of the expanded units' clusters, kept in the scratch row of this program
    lo = float("inf")
    hi = float("-inf")
    for blk in range(0, L, BLOCK_L):
        offs_l = blk + tl.arange(0, BLOCK_L)
        lmask = offs_l < L
        par = tl.load(FPar + (fo + offs_l) * H + h, mask=lmask, other=0)
        live = tl.load(Scratch + pid * BLOCK_P + par, mask=lmask, other=0) > 0
        fr = tl.load(FR + (fo + offs_l) * H + h, mask=lmask, other=float("-inf"))
        fmu = tl.load(FMu + (fo + offs_l)[:, None] * stride_fm + h * D + offs_d[None, :],
                      mask=lmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(fmu)) + qn[:, None] * fr[None, :]
        fub = tl.max(tl.where(gmask[:, None], s, float("-inf")), 0)
        fub = tl.where(live & lmask & (fr > float("-inf")), fub, float("-inf"))
        tl.store(Sel + (fo + offs_l) * H + h, fub, mask=lmask)
        finite = fub > float("-inf")
        lo = tl.minimum(lo, tl.min(tl.where(finite, fub, float("inf")), 0))
        hi = tl.maximum(hi, tl.max(fub, 0))
    tl.debug_barrier()

    # bisection: the smallest threshold whose clusters (bound >= threshold) fit the budget
    a = lo - 1.0    # everything above a: may not fit
    c = hi + 1.0    # nothing above c: fits
    if ONE_BLOCK:
        # every cluster of the request fits one block: keep the bounds in registers across the bisection
        offs_l = tl.arange(0, BLOCK_B)
        lmask = offs_l < L
        fub = tl.load(Sel + (fo + offs_l) * H + h, mask=lmask, other=float("-inf"))
        ftok = tl.load(FTok + (fo + offs_l) * H + h, mask=lmask, other=0.0).to(tl.float32)
        for _ in range(ITERS):
            mid = (a + c) * 0.5
            fits = tl.sum(tl.where(fub >= mid, ftok, 0.0), 0) <= budget
            c = tl.where(fits, mid, c)
            a = tl.where(fits, a, mid)
    else:
        for _ in range(ITERS):
            mid = (a + c) * 0.5
            total = 0.0
            for blk in range(0, L, BLOCK_B):
                offs_l = blk + tl.arange(0, BLOCK_B)
                lmask = offs_l < L
                fub = tl.load(Sel + (fo + offs_l) * H + h, mask=lmask, other=float("-inf"))
                ftok = tl.load(FTok + (fo + offs_l) * H + h, mask=lmask, other=0.0).to(tl.float32)
                total += tl.sum(tl.where(fub >= mid, ftok, 0.0), 0)
            fits = total <= budget
            c = tl.where(fits, mid, c)
            a = tl.where(fits, a, mid)
    tl.debug_barrier()
    for blk in range(0, L, BLOCK_B):
        offs_l = blk + tl.arange(0, BLOCK_B)
        lmask = offs_l < L
        fub = tl.load(Sel + (fo + offs_l) * H + h, mask=lmask, other=float("-inf"))
        take = (fub >= c) & (fub > float("-inf"))
        tl.store(Sel + (fo + offs_l) * H + h, take.to(tl.float32), mask=lmask)


def select_fine(q, coarse, fine, co, pn, fo, ln, budget, expand: float, max_coarse: int = 64,
                max_fine: int | None = None):
    """-> sel [F, H] float32 (1.0 = take) for the batch's fine rows; other rows untouched.

    ``max_fine`` (host-side upper bound on the batch's fine-cluster counts, known from the batch plan) picks
    the variant that keeps a request's bounds in registers when they fit one block of 4096.

    coarse = (mu [C,H,d], r [C,H], tok [C,H]); fine = (mu [F,H,d], r [F,H], tok [F,H], parent [F,H] int32)
    co/pn/fo/ln/budget: [bs] int32 per batch row.
    """
    bs, Hq, D = q.shape
    cmu, cr, ctok = coarse
    fmu, fr, ftok, fpar = fine
    H = cmu.shape[1]
    G = Hq // H
    BLOCK_P = max(16, triton.next_power_of_2(max_coarse))
    one_block = max_fine is not None and max_fine <= 4096
    sel = torch.empty(fr.shape, dtype=torch.float32, device=q.device)
    scratch = torch.empty(bs * H * BLOCK_P, dtype=torch.int32, device=q.device)
    _select_fine_kernel[(bs * H,)](
        q, cmu, cr, ctok, fmu, fr, ftok, fpar, co, pn, fo, ln, budget, scratch, sel, float(expand),
        q.stride(0), q.stride(1), cmu.stride(0), fmu.stride(0),
        H=H, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_P=BLOCK_P, BLOCK_L=64, BLOCK_B=4096 if one_block else 1024, ITERS=40, ONE_BLOCK=one_block)
    return sel


@triton.jit
def _emit_kernel(Sel, CFine, CStart, CLen, Fo, Ko, Mn, Rows, SeqLen, ReqToToken, Out, Lens, stride_rt,
                 sink, recent, H: tl.constexpr, CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                 MAXLEN: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    fo = tl.load(Fo + b)
    ko = tl.load(Ko + b)
    M = tl.load(Mn + b)
    row = tl.load(Rows + b).to(tl.int64)
    S = tl.load(SeqLen + b)
    n_sink = tl.minimum(sink, S)
    rec_start = tl.maximum(n_sink, S - recent)
    base = pid * CAP
    # sink
    for t in range(0, n_sink, BLOCK_T):
        pos = t + tl.arange(0, BLOCK_T)
        m = pos < n_sink
        tl.store(Out + base + pos, tl.load(ReqToToken + row * stride_rt + pos, mask=m, other=0), mask=m)
    n = n_sink
    # selected chunks, minus what the sink and the recent window already cover
    for blk in range(0, M, BLOCK_M):
        offs = blk + tl.arange(0, BLOCK_M)
        mm = offs < M
        cf = tl.load(CFine + (ko + offs) * H + h, mask=mm, other=0)
        take = (tl.load(Sel + (fo + cf) * H + h, mask=mm, other=0.0) > 0) & mm
        st = tl.load(CStart + ko + offs, mask=mm, other=0)
        ln = tl.load(CLen + ko + offs, mask=mm, other=0)
        en = tl.minimum(st + ln, rec_start)
        st = tl.maximum(st, n_sink)
        cnt = tl.where(take, tl.maximum(en - st, 0), 0)
        dst = n + tl.cumsum(cnt, 0) - cnt
        # every taken chunk's tokens at once: [BLOCK_M chunks, MAXLEN tokens]
        k = tl.arange(0, MAXLEN)
        m2 = (k[None, :] < cnt[:, None]) & ((dst[:, None] + k[None, :]) < CAP)
        slot = tl.load(ReqToToken + row * stride_rt + st[:, None] + k[None, :], mask=m2, other=0)
        tl.store(Out + base + dst[:, None] + k[None, :], slot, mask=m2)
        n += tl.sum(cnt, 0)
    # recent window
    for t in range(rec_start, S, BLOCK_T):
        pos = t + tl.arange(0, BLOCK_T)
        m = (pos < S) & (n + pos - rec_start < CAP)
        tl.store(Out + base + n + pos - rec_start, tl.load(ReqToToken + row * stride_rt + pos, mask=m, other=0), mask=m)
    n += S - rec_start
    tl.store(Lens + pid, tl.minimum(n, CAP))


def emit_tokens(sel, chunks, fo, ko, mn, rows, seq_lens, req_to_token, sink: int, recent: int, cap: int,
                max_chunk: int = 16):
    """-> (indptr [bs*H+1] int32, indices [bs*H*cap] int32) for kernels/sparse_decode.py.

    chunks = (fine [K,H] int32 local fine index, start [K] int32, length [K] int32 <= max_chunk); rows: request
    pool rows.
    Each list holds at most ``cap`` slots (sized by the caller from the budget); lists are laid out in
    fixed windows, so the returned CSR points into them.
    """
    cfine, cstart, clen = chunks
    bs, H = rows.shape[0], sel.shape[1]
    out = torch.empty(bs * H * cap, dtype=torch.int32, device=sel.device)
    lens = torch.empty(bs * H, dtype=torch.int32, device=sel.device)
    _emit_kernel[(bs * H,)](sel, cfine, cstart, clen, fo, ko, mn, rows, seq_lens, req_to_token, out, lens,
                            req_to_token.stride(0), sink, recent, H=H, CAP=cap, BLOCK_M=64, BLOCK_T=64,
                            MAXLEN=triton.next_power_of_2(max_chunk))
    return lens, out


def compact(lens: torch.Tensor, windows: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed windows -> CSR (indptr, indices) with device ops only (graph-safe: static shapes)."""
    n = lens.shape[0]
    indptr = torch.zeros(n + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(lens, 0)
    pos = torch.arange(cap, device=lens.device)[None, :]
    keep = pos < lens[:, None]
    dest = torch.where(keep, indptr[:-1, None].long() + pos, n * cap)  # dropped entries go past the end
    indices = torch.zeros(n * cap + 1, dtype=torch.int32, device=lens.device)
    indices.scatter_(0, dest.flatten(), windows.view(n, cap).flatten())
    return indptr, indices[:-1]


def pack(indexes, chunk_starts, chunk_lens, device):
    """Host-side packing of per-request ClusterIndex objects into node pools (tests; the backend's pools later).

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
    coarse = (cat([ix.coarse_mu.transpose(0, 1) for ix in indexes]).contiguous(),
              cat([ix.coarse_r.T for ix in indexes]).contiguous(),
              cat([ix.coarse_tokens.T for ix in indexes]).contiguous())
    fine = (cat([ix.fine_mu.transpose(0, 1) for ix in indexes]).contiguous(),
            cat([ix.fine_r.T for ix in indexes]).contiguous(),
            cat([ix.fine_tokens.T for ix in indexes]).contiguous(),
            cat([ix.fine_parent.T for ix in indexes]).to(torch.int32).contiguous())
    chunks = (cat([ix.chunk_fine.T for ix in indexes]).to(torch.int32).contiguous(),
              cat(list(chunk_starts)).to(torch.int32), cat(list(chunk_lens)).to(torch.int32))
    ranges = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (co, pn, fo, ln, ko, mn))
    return coarse, fine, chunks, ranges
