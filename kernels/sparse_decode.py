"""Sparse decode attention over per-(request, KV head) slot lists in CSR form.

One program serves a whole GQA group (every selected K/V row is read once for the group's query
heads) over one split of its list (flash-decoding); a second kernel merges the splits by
log-sum-exp. bf16/fp16 in, fp32 accumulation. Lists may differ per KV head, so hybrid heads
(dense retrieval heads beside sparse ones) are just longer lists.

    indptr  [bs * H + 1] int32   list of (request b, KV head h) is indices[indptr[b*H+h] : indptr[b*H+h+1]]
    indices [capacity]   int32   KV slots (rows of SGLang's per-layer K/V buffers)

or, for lists in fixed windows (``kernels/select.py:emit_tokens``), ``indptr[i]`` the start of list ``i``
and ``lens[i]`` its length. With ``direct`` = (flags, rows, seq_lens, req_to_token), a request whose flag
is set attends to its whole sequence instead, read straight from its ``req_to_token`` row: the dense
fallback of a request whose index has no room in the pools, inside the same captured launch. A fifth entry,
``tail_from`` [bs], adds to each list the request's positions ``[tail_from, seq_len)`` read from that row: the
tokens decoded since a list selected a few steps before (config ``select_every``). With ``tail_ring`` R > 0 the
tail is read from a ring instead (the host tier's, ``sgl_sparsekv/tier_rows.py``): ``rows[b]`` is its first buffer
row and position p sits at row ``rows[b] + p % R``; ``req_to_token`` is not read. With ``list_rows`` [bs],
request ``b``'s lists are those of list row ``list_rows[b]`` (``indptr``/``lens`` entry ``list_rows[b] * H + h``),
so lists kept across steps need not move when the batch changes.

Capacities are fixed by the caller (budget x bs x H), so the launch has static shapes and can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def group_block(G: int) -> int:
    """Query-head rows of a group as the kernels hold them (``tl.dot`` wants at least 16)."""
    return max(16, triton.next_power_of_2(G))


@triton.jit
def _split(start, end, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Entries [lo, hi) of ``[start, end)`` for split ``split`` of ``SPLITS``, in whole tiles of BLOCK_N."""
    per = tl.cdiv(tl.cdiv(end - start, SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * per
    return lo, tl.minimum(end, lo + per)


@triton.jit
def _group_query(Q, b, h, stride_qb, stride_qh, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The query heads of KV head ``h``'s group, [BLOCK_G, BLOCK_D] (rows past G and columns past D are 0)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                   mask=(offs_g < G)[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _rows_of(X, slot, valid, h, stride_xn, stride_xh, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(X + slot[:, None] * stride_xn + h * stride_xh + offs_d[None, :],
                   mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _slot_tile(Src, X, blk, hi, h, stride_xn, stride_xh, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """List entries ``blk ..`` before ``hi``: (their KV slots, which are valid, the rows of buffer X they name)."""
    offs_n = blk + tl.arange(0, BLOCK_N)
    valid = offs_n < hi
    slot = tl.load(Src + offs_n, mask=valid, other=0).to(tl.int64)
    return slot, valid, _rows_of(X, slot, valid, h, stride_xn, stride_xh, D, BLOCK_D)


@triton.jit
def _list_and_tail_tile(Src, n_list, Tail, ring_at, tail_pos, X, blk, hi, h, stride_xn, stride_xh, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, RING: tl.constexpr):
    """As ``_slot_tile`` over a list's ``n_list`` entries at ``Src`` followed by the tail's: at ``Tail``, or with
    ``RING`` the rows ``ring_at + p % RING`` of positions p from ``tail_pos`` on."""
    offs_n = blk + tl.arange(0, BLOCK_N)
    valid = offs_n < hi
    in_list = offs_n < n_list
    if RING > 0:
        tail = ring_at + (tail_pos + offs_n - n_list) % RING
    else:
        tail = tl.load(Tail + (offs_n - n_list), mask=valid & (offs_n >= n_list), other=0)
    slot = tl.where(in_list, tl.load(Src + offs_n, mask=valid & in_list, other=0), tail).to(tl.int64)
    return slot, valid, _rows_of(X, slot, valid, h, stride_xn, stride_xh, D, BLOCK_D)


@triton.jit
def _partial_kernel(Q, K, V, Indptr, Lens, ListRows, Indices, OPart, LsePart, sm_scale,
                    Direct, Rows, SeqLen, ReqToToken, TailFrom, stride_rt,
                    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_LENS: tl.constexpr,
                    HAS_DIRECT: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_LIST_ROWS: tl.constexpr,
                    RING: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)   # b * H + h
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    li = pid
    if HAS_LIST_ROWS:
        li = tl.load(ListRows + b).to(tl.int64) * H + h
    start = tl.load(Indptr + li).to(tl.int64)
    if HAS_LENS:
        n_list = tl.load(Lens + li).to(tl.int64)
    else:
        n_list = tl.load(Indptr + li + 1).to(tl.int64) - start
    src = Indices + start
    tail = src
    n_tail = n_list * 0
    ring_at = n_tail
    tail_pos = n_tail
    if HAS_DIRECT:   # the whole sequence (dense fallback), or the list and its tail
        row = tl.load(Rows + b).to(tl.int64)
        ring_at = row
        tail = ReqToToken + row * stride_rt
        seq = tl.load(SeqLen + b).to(tl.int64)
        if tl.load(Direct + b) != 0:
            n_list = n_list * 0
            n_tail = seq
        elif HAS_TAIL:
            tail_pos = tl.load(TailFrom + b).to(tl.int64)
            tail += tail_pos
            n_tail = seq - tail_pos
    lo, hi = _split(0, n_list + n_tail, split, SPLITS, BLOCK_N)
    q = _group_query(Q, b, h, stride_qb, stride_qh, G, BLOCK_G, D, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for blk in range(lo, hi, BLOCK_N):
        slot, valid, k = _list_and_tail_tile(src, n_list, tail, ring_at, tail_pos, K, blk, hi, h, stride_kn,
                                             stride_kh, D, BLOCK_D, BLOCK_N, RING)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale   # fp8 KV dequantizes on load
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vn + h * stride_vh + offs_d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    base = (pid * SPLITS + split) * BLOCK_G
    tl.store(OPart + (base + offs_g)[:, None] * BLOCK_D + offs_d[None, :], out)
    tl.store(LsePart + base + offs_g, lse)


@triton.jit
def _merge_kernel(OPart, LsePart, O, stride_ob, stride_oh,
                  H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(LsePart + (pid * SPLITS + s) * BLOCK_G + offs_g))
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        base = (pid * SPLITS + s) * BLOCK_G
        w = tl.exp(tl.load(LsePart + base + offs_g) - safe_m)
        den += w
        acc += w[:, None] * tl.load(OPart + (base + offs_g)[:, None] * BLOCK_D + offs_d[None, :])
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    mask = (offs_g < G)[:, None] & (offs_d < D)[None, :]
    tl.store(O + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask)


def sparse_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            indptr: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                            out: torch.Tensor | None = None, num_splits: int = 8, block_n: int = 32,
                            workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                            lens: torch.Tensor | None = None, direct: tuple | None = None,
                            list_rows: torch.Tensor | None = None, tail_ring: int = 0) -> torch.Tensor:
    """q [bs, Hq, d]; k/v_buffer [slots, H, d]; indptr [bs*H+1]; indices [cap] -> out [bs, Hq, d].

    ``direct`` = (flags [bs] int32, rows [bs] int32, seq_lens [bs] int32, req_to_token [R, C] int32[, tail_from
    [bs] int32]): requests whose flag is set attend to ``req_to_token[row, :seq_len]``, the others to their list
    and ``req_to_token[row, tail_from:seq_len]``, or with ``tail_ring`` their tail from a ring (see the module
    docstring; a ring's tail comes with the list only, never as a whole sequence).

    ``workspace`` (partial outputs and log-sum-exps, see :func:`workspace_for`) can be preallocated
    once for CUDA graphs.
    """
    bs, Hq, D = q.shape
    H = k_buffer.shape[1]
    G = Hq // H
    BLOCK_G = group_block(G)
    BLOCK_D = triton.next_power_of_2(D)
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        workspace = workspace_for(bs, H, G, D, num_splits, q.device)
    opart, lse = workspace
    flags, rows, seq_lens, req_to_token, *tail = direct if direct is not None else (indptr, indptr, indptr,
                                                                                    indices[None])
    _partial_kernel[(bs * H, num_splits)](
        q, k_buffer, v_buffer, indptr, indptr if lens is None else lens, indptr if list_rows is None else list_rows,
        indices, opart, lse, sm_scale,
        flags, rows, seq_lens, req_to_token, tail[0] if tail else flags, req_to_token.stride(0),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        H=H, G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, SPLITS=num_splits,
        HAS_LENS=lens is not None, HAS_DIRECT=direct is not None, HAS_TAIL=bool(tail),
        HAS_LIST_ROWS=list_rows is not None, RING=tail_ring)
    _merge_kernel[(bs * H,)](opart, lse, out, out.stride(0), out.stride(1),
                             H=H, G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, SPLITS=num_splits)
    return out


def workspace_for(bs: int, H: int, G: int, D: int, num_splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    BLOCK_G = group_block(G)
    BLOCK_D = triton.next_power_of_2(D)
    return (torch.empty(bs * H * num_splits * BLOCK_G * BLOCK_D, dtype=torch.float32, device=device),
            torch.empty(bs * H * num_splits * BLOCK_G, dtype=torch.float32, device=device))


def sparse_decode_attention_ref(q, k_buffer, v_buffer, indptr, indices, sm_scale, lens=None, direct=None,
                                list_rows=None, tail_ring: int = 0):
    """Torch twin: plain softmax attention per (request, KV head) over its slot list, in fp32."""
    bs, Hq, D = q.shape
    H = k_buffer.shape[1]
    G = Hq // H
    out = torch.zeros(bs, Hq, D, dtype=torch.float32, device=q.device)
    ptr = indptr.tolist()
    ends = ptr[1:] if lens is None else [p + n for p, n in zip(ptr, lens.tolist())]
    lrows = list(range(bs)) if list_rows is None else list_rows.tolist()
    for b in range(bs):
        for h in range(H):
            li = lrows[b] * H + h
            slots = indices[ptr[li]:ends[li]].long()
            if direct is not None:
                flags, rows, seq_lens, req_to_token, *tail = direct
                if tail_ring:   # the positions' rows in the ring from rows[b]
                    seq = int(rows[b]) + torch.arange(int(seq_lens[b]), device=slots.device) % tail_ring
                else:
                    seq = req_to_token[int(rows[b]), :int(seq_lens[b])].long()
                if int(flags[b]):
                    slots = seq
                elif tail:
                    slots = torch.cat([slots, seq[int(tail[0][b]):]])
            if len(slots) == 0:
                continue
            qh = q[b, h * G:(h + 1) * G].float()
            k = k_buffer[slots, h].float()
            v = v_buffer[slots, h].float()
            p = torch.softmax(qh @ k.T * sm_scale, dim=-1)
            out[b, h * G:(h + 1) * G] = p @ v
    return out.to(q.dtype)
