"""Two-stage selection: of lychee's candidate tokens, keep the budget's best by the query group's attention.

With ``rerank_factor`` f > 1 the cut and emission pick f times the budget past the sink and the recent window, one
candidate list per (request, KV head) in a window of ``cap_c`` entries, laid out ``[sink | chunk tokens | recent]``
as ``emit_tokens`` writes it. Then, per sparse layer:

- ``_score_kernel`` (``parts_for`` programs per list: more where the batch has few lists) reads the candidates'
  keys once and writes the logits of the group's query heads and each part's softmax statistics (running max and
  sum, as in flash decoding);
- ``_keep_kernel`` (one program per list) scores each candidate by the group's attention over the candidates (the
  sum over query heads of softmax probabilities, so every head's distribution counts alike), keeps the sink, the
  recent window and the ``keep`` best middle tokens (ties to the earlier entry), and writes them compacted, in list
  order, into the attention's windows of ``cap`` entries.

The threshold is the ``keep``-th largest score, found without sorting: scores are non-negative floats, whose bit
patterns order as integers, and a radix search fixes eight bits of it per pass (four histograms of 256 bins over the
keys that match the bits fixed so far). Values are read only for the kept tokens, by the attention. No host read,
static shapes: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparsekv.kernels.select import _program_head, all_heads
from sgl_sparsekv.kernels.sparse_decode import _group_query, _slot_tile, _split, group_block


@triton.jit
def _score_kernel(Q, K, Cand, CandLens, Logits, Stats, Heads, R, sm_scale, stride_qb, stride_qh, stride_kn, stride_kh,
                  H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  CAPC: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b, h = _program_head(pid, Heads, R)
    lst = b * H + h
    lo, hi = _split(0, tl.load(CandLens + lst), part, PARTS, BLOCK_N)
    q = _group_query(Q, b, h, stride_qb, stride_qh, G, BLOCK_G, D, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    rows = Logits + (lst * G + offs_g)[:, None] * CAPC
    for blk in range(lo, hi, BLOCK_N):
        offs_n = blk + tl.arange(0, BLOCK_N)
        _, valid, k = _slot_tile(Cand + lst * CAPC, K, blk, hi, h, stride_kn, stride_kh, D, BLOCK_D, BLOCK_N)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        tl.store(rows + offs_n[None, :], s, mask=gmask[:, None] & valid[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(s - safe[:, None]), 1)
        m_i = m_new
    base = (lst * PARTS + part) * 2 * BLOCK_G
    tl.store(Stats + base + offs_g, m_i)
    tl.store(Stats + base + BLOCK_G + offs_g, l_i)


@triton.jit
def _keep_kernel(Cand, CandLens, Logits, Stats, SeqLen, Out, Lens, Heads, R, dense_limit, sink, recent, keep,
                 H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, CAPC: tl.constexpr, CAP: tl.constexpr,
                 BLOCK: tl.constexpr, PARTS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, h = _program_head(pid, Heads, R)
    lst = b * H + h
    n = tl.load(CandLens + lst)
    S = tl.load(SeqLen + b)
    dense = S <= dense_limit   # emission gave it its whole sequence (at most the budget): all kept
    n_sink = tl.where(dense, n, tl.minimum(sink, S))
    n_rec = tl.where(dense, 0, tl.minimum(S - tl.maximum(n_sink, S - recent), n - n_sink))
    mid_end = n - n_rec

    # each query head's log-sum-exp over all candidates, from the parts' statistics
    offs_p = tl.arange(0, PARTS)
    offs_g = tl.arange(0, BLOCK_G)
    st = Stats + (lst * PARTS + offs_p)[:, None] * 2 * BLOCK_G + offs_g[None, :]
    m_p = tl.load(st)
    l_p = tl.load(st + BLOCK_G)
    m = tl.max(m_p, 0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    lse = safe + tl.log(tl.sum(l_p * tl.exp(m_p - safe[None, :]), 0))

    offs = tl.arange(0, BLOCK)
    valid = offs < n
    middle = (offs >= n_sink) & (offs < mid_end)
    score = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(G):
        lse_g = tl.sum(tl.where(offs_g == g, lse, 0.0), 0)
        s = tl.load(Logits + (lst * G + g) * CAPC + offs, mask=middle, other=float("-inf"))
        score += tl.exp(s - lse_g)
    # non-negative floats order as their bit patterns: the keep-th largest key, eight bits per pass
    key = score.to(tl.int32, bitcast=True)
    need = mid_end - n_sink > keep
    bins = tl.arange(0, 256)
    prefix = 0
    left = keep          # keys still to take among those matching the bits fixed so far
    match = middle
    for p in tl.static_range(4):
        digit = (key >> (24 - 8 * p)) & 0xFF
        hist = tl.histogram(digit, 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist   # matching keys whose digit is >= the bin's
        d = tl.max(tl.where(at_least >= left, bins, 0), 0)
        left -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix += d << (24 - 8 * p)
        match = match & (digit == d)
    key = tl.where(middle, key, -1)   # entries outside the middle rank below every middle one
    above = key > prefix
    tie = key == prefix
    tie_rank = tl.cumsum(tie.to(tl.int32), 0)
    taken = above | (tie & (tie_rank <= keep - tl.sum(above.to(tl.int32), 0)))
    kept = valid & (~middle | ~need | taken)
    dst = tl.cumsum(kept.to(tl.int32), 0) - 1
    slot = tl.load(Cand + lst * CAPC + offs, mask=kept, other=0)
    tl.store(Out + lst * CAP + dst, slot, mask=kept & (dst < CAP))
    tl.store(Lens + lst, tl.minimum(tl.sum(kept.to(tl.int32), 0), CAP))


MAX_PARTS = 32
SCORE_BLOCK = 64   # candidates per tile of the score kernel


def parts_for(lists: int) -> int:
    """Score programs per candidate list: with few lists (a small batch) more programs split each one. On an H200 at
    Llama-3.1-8B's group shape and budget 1024 (``bench/results/rerank_kernels_h200.json``), 32 parts score 8 lists
    in 0.0045 ms against 0.0082 with 8, 16 parts score 32 lists in 0.0079 ms against 0.0099 with 8 and 0.0093 with
    32; 128 lists take 0.026-0.028 ms with 8, 16 or 32 parts."""
    return max(8, min(MAX_PARTS, triton.next_power_of_2(max(1, 512 // max(1, lists)))))


def workspace_for(max_bs: int, H: int, G: int, cap_c: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [max_bs * H * G * cap_c] and the parts' softmax statistics, fp32, allocated once."""
    return (torch.empty(max_bs * H * G * cap_c, dtype=torch.float32, device=device),
            torch.empty(max_bs * H * MAX_PARTS * 2 * group_block(G), dtype=torch.float32, device=device))


def rerank_tokens(q, k_buffer, cand, seq_lens, sm_scale: float, sink: int, recent: int, keep: int, cap: int,
                  dense_limit: int, out, workspace, heads: torch.Tensor | None = None):
    """q [bs, Hq, d]; k_buffer [slots, H, d]; cand = (lens [>= bs*H] int32, windows [>= bs*H*cap_c] int32), the
    candidate lists; out = (lens, windows) of lists of at most ``cap`` entries, written for the KV heads ``heads``
    only (int32, default all). ``keep``: middle tokens kept per list past the sink and the recent window."""
    bs, Hq, D = q.shape
    H = k_buffer.shape[1]
    G = Hq // H
    cand_lens, cand_windows = cand
    cap_c = cand_windows.numel() // cand_lens.numel()
    heads = all_heads(H, q.device) if heads is None else heads
    R = heads.numel()
    parts = parts_for(bs * R)
    logits, stats = workspace
    bg = group_block(G)
    _score_kernel[(bs * R, parts)](q, k_buffer, cand_windows, cand_lens, logits, stats, heads, R, sm_scale, q.stride(0),
                                   q.stride(1), k_buffer.stride(0), k_buffer.stride(1), H=H, G=G, BLOCK_G=bg, D=D,
                                   BLOCK_D=triton.next_power_of_2(D), CAPC=cap_c, BLOCK_N=SCORE_BLOCK, PARTS=parts)
    _keep_kernel[(bs * R,)](cand_windows, cand_lens, logits, stats, seq_lens, out[1], out[0], heads, R, dense_limit,
                            sink, recent, keep, H=H, G=G, BLOCK_G=bg, CAPC=cap_c, CAP=cap,
                            BLOCK=triton.next_power_of_2(cap_c), PARTS=parts, num_warps=8)
    return out


def rerank_tokens_ref(q, k_buffer, cand, seq_lens, sm_scale: float, sink: int, recent: int, keep: int, cap: int,
                      dense_limit: int, out, workspace=None, heads: torch.Tensor | None = None):
    """Torch twin of :func:`rerank_tokens`, in fp32: a stable sort of the middle's scores, ties to the earlier entry."""
    bs, Hq, D = q.shape
    H = k_buffer.shape[1]
    G = Hq // H
    cand_lens, cand_windows = cand
    cap_c = cand_windows.numel() // cand_lens.numel()
    lens, windows = out
    for b, S in enumerate(seq_lens[:bs].tolist()):
        for h in (range(H) if heads is None else heads.tolist()):
            i = b * H + h
            n = int(cand_lens[i])
            lst = cand_windows[i * cap_c:i * cap_c + n]
            if S <= dense_limit:
                kept = lst
            else:
                n_sink = min(sink, S)
                n_rec = min(S - max(n_sink, S - recent), n - n_sink)
                mid = lst[n_sink:n - n_rec]
                if len(mid) > keep:
                    logits = q[b, h * G:(h + 1) * G].float() @ k_buffer[lst.long(), h].float().T * sm_scale
                    score = torch.softmax(logits, -1).sum(0)[n_sink:n - n_rec]
                    order = torch.sort(score, descending=True, stable=True).indices[:keep]
                    mid = mid[order.sort().values]
                kept = torch.cat([lst[:n_sink], mid, lst[n - n_rec:]])
            kept = kept[:cap]
            windows[i * cap:i * cap + len(kept)] = kept
            lens[i] = len(kept)
    return out
