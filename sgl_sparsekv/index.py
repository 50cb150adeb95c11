"""The LycheeCluster index of one request and layer: chunks -> fine clusters -> coarse units.

All tensors are batched over the layer's KV heads ``H``; each head clusters on its own.
Every node keeps its centroid ``mu`` and a covering radius ``r`` such that for every chunk key
``k`` below it, ``|k - mu| <= r``. Then for any query ``q`` (Cauchy-Schwarz)

    q.k <= q.mu + |q| r = UB(q, node)

Optionally (``fine_bound`` "box") every fine cluster also keeps the box of its tokens' raw keys, as a center ``c``
and a half-width ``w`` per dimension, and fine clusters rank by ``q.c + |q|.w``: for every key ``k`` in the box,
``q.k <= sum_i max(q_i lo_i, q_i hi_i)``, Quest's page bound, on the request's own chunks. A chunk's mean key
averages away the one token a copying query needs; its box keeps it.

A coarse unit's radius covers its descendants' *chunks* (``max |mu_c - mu_g| + r_c`` over its
fine clusters), not only the fine centroids, so a coarse bound is never below any of its
children's bounds: pruning by coarse bounds never drops a cluster that the fine bounds would
rank above a kept one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_sparsekv.kernels.kmeans import cluster_sums, cluster_sums_ref, nearest_centroid, nearest_centroid_ref

NEG_INF = float("-inf")
# centroids are stored as int8 codes times a power-of-two scale per (node, head): half of bf16's memory and of the
# bytes selection reads. A power of two keeps code x scale exact (in fp32 and in bf16, 8 significant bits), so
# storing a stored centroid gives it back unchanged. Every radius is measured from the stored centroid, so the
# bounds hold exactly for what the kernels read.
CODE_DTYPE = torch.int8
CODE_MAX = 127
# fine boxes (``fine_bound`` "box") in bf16: int8 codes with one scale per box (as centroids are stored) lose the
# small dimensions of keys with a few large ones, and with them what tells near-identical chunks apart
BOX_DTYPE = torch.bfloat16


def centroid_scale(mu: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [...] fp32: the smallest power of two s with max |mu| <= 127 s (1 for a zero row), from the bits
    of max |mu| / 127 as ``kernels/graft.py`` computes it."""
    t = mu.abs().amax(-1).float() / CODE_MAX
    bits = t.view(torch.int32)
    up = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)) << 23
    return torch.where(t > 0, up.view(torch.float32), torch.ones_like(t))


def quantize(mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] float -> (codes [..., d] int8, scale [...] fp32), ties to even."""
    scale = centroid_scale(mu)
    return torch.round(mu.float() / scale[..., None]).clamp(-CODE_MAX, CODE_MAX).to(CODE_DTYPE), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[..., None]


def stored(mu: torch.Tensor) -> torch.Tensor:
    """fp32 centroids as the index pools store them (``quantize`` then ``dequantize``)."""
    return dequantize(*quantize(mu))


def quantize_box(box: torch.Tensor) -> torch.Tensor:
    """[..., 2, d] (center, half-width) -> the same in ``BOX_DTYPE``: the center rounds to the nearest value; the
    half-width grows by the center's rounding and rounds up, so the stored box covers the original one. Storing a
    stored box gives it back unchanged."""
    center, half = box[..., 0, :].float(), box[..., 1, :].float()
    c = center.to(BOX_DTYPE)
    w = (center - c.float()).abs() + half
    wb = w.to(BOX_DTYPE)
    # round up: below w, the next value of the type (w >= 0: the next bit pattern)
    wb = torch.where(wb.float() < w, (wb.view(torch.int16) + 1).view(BOX_DTYPE), wb)
    return torch.stack([c, wb], -2)


def box_from(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per-dimension key bounds [..., d] -> the stored box [..., 2, d] that covers them (center, half-width); an
    empty one (lo > hi, as an empty cluster's +inf / -inf) is the zero box."""
    empty = (lo > hi).any(-1, keepdim=True)
    lo, hi = lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)
    return quantize_box(torch.stack([(lo + hi) / 2, (hi - lo) / 2], -2)).float()


def box_union(box: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, grow: torch.Tensor) -> torch.Tensor:
    """The stored box covering ``box`` [..., 2, d] and the keys in [lo, hi] [..., d]; where ``grow`` [...] is false
    (an empty cluster: no member to keep covered) the keys' box alone."""
    g = grow[..., None]
    return box_from(torch.where(g, torch.minimum(box[..., 0, :] - box[..., 1, :], lo), lo),
                    torch.where(g, torch.maximum(box[..., 0, :] + box[..., 1, :], hi), hi))


def spherical_kmeans(x: torch.Tensor, k: int, iters: int):
    """Batched spherical k-means with inner-product assignment.

    x: [H, N, d] unit vectors. Deterministic: centroids start at evenly spaced points. On the GPU the
    assignment and the sums run in ``kernels/kmeans.py`` (no [H, N, k] similarity matrix in memory; sums in
    a fixed order, so a build gives the same index every time).
    Returns (centroids [H, k, d] unit, assign [H, N] int64). A cluster that loses all members
    keeps its previous centroid (and is reported empty by its zero count downstream).
    """
    H, N, d = x.shape
    k = max(1, min(k, N))
    if k == N:   # every point its own cluster: the fixed point the iterations start at, without N x N similarities
        return x.clone(), torch.arange(N, device=x.device).expand(H, N).clone()
    init = torch.linspace(0, N - 1, k, device=x.device).round().long()
    cent = x[:, init].clone()
    assign = torch.zeros(H, N, dtype=torch.long, device=x.device)
    nearest, sums_of = (nearest_centroid, cluster_sums) if x.is_cuda else (nearest_centroid_ref, cluster_sums_ref)
    for _ in range(max(1, iters)):
        assign = nearest(x, cent)
        sums, counts = sums_of(x, assign, k)
        cent = torch.where(counts[..., None] > 0, F.normalize(sums, dim=-1), cent)
    return cent, assign


def scatter_max(src: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.full(src.shape[:-1] + (n,), NEG_INF, dtype=src.dtype, device=src.device)
    return out.scatter_reduce_(-1, index, src, reduce="amax", include_self=True)


def scatter_sum(src: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(src.shape[:-1] + (n,), dtype=src.dtype, device=src.device)
    return out.scatter_add_(-1, index, src)


@dataclass
class ClusterIndex:
    """Three-level index over ``M`` chunks for ``H`` KV heads (one request, one layer)."""

    fine_mu: torch.Tensor      # [H, L, d]
    fine_r: torch.Tensor       # [H, L]; -inf for empty clusters
    fine_n: torch.Tensor       # [H, L] chunks per fine cluster
    fine_tokens: torch.Tensor  # [H, L] tokens per fine cluster
    fine_parent: torch.Tensor  # [H, L] coarse unit of each fine cluster
    coarse_mu: torch.Tensor    # [H, P, d]
    coarse_r: torch.Tensor     # [H, P]
    coarse_n: torch.Tensor     # [H, P] chunks per coarse unit
    coarse_tokens: torch.Tensor  # [H, P]
    chunk_fine: torch.Tensor   # [H, M] fine cluster of each chunk
    # [H, L, 2, d] (center, half-width) of each fine cluster's token keys with fine_bound "box"; else [H, L, 2, 0]
    fine_box: torch.Tensor | None = None

    def __post_init__(self):
        if self.fine_box is None:
            self.fine_box = self.fine_r.new_zeros(*self.fine_r.shape, 2, 0)

    @property
    def has_box(self) -> bool:
        return self.fine_box.shape[-1] > 0

    @property
    def num_chunks(self) -> int:
        return self.chunk_fine.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())

    def clone(self) -> "ClusterIndex":
        return ClusterIndex(**{k: v.clone() for k, v in vars(self).items()})

    def pack(self) -> "PackedIndex":
        """The index with its centroids as int8 codes and scales (``quantize``), as the pools store it."""
        (fine, fine_scale), (coarse, coarse_scale) = quantize(self.fine_mu), quantize(self.coarse_mu)
        rest = {k: v.clone() for k, v in vars(self).items() if not k.endswith("_mu") and k != "fine_box"}
        return PackedIndex(ClusterIndex(fine_mu=fine, coarse_mu=coarse, fine_box=quantize_box(self.fine_box), **rest),
                           fine_scale, coarse_scale)


@dataclass
class PackedIndex:
    """A ClusterIndex as the index pools hold it and the index cache keeps it: each centroid as its int8 codes
    and power-of-two scale. Exact for stored centroids (``stored``), in half of bf16's bytes."""

    index: ClusterIndex          # its fine_mu / coarse_mu hold the codes, its fine_box the boxes in BOX_DTYPE
    fine_scale: torch.Tensor     # [H, L]
    coarse_scale: torch.Tensor   # [H, P]

    @property
    def num_chunks(self) -> int:
        return self.index.num_chunks

    def nbytes(self) -> int:
        return self.index.nbytes() + sum(t.numel() * t.element_size() for t in (self.fine_scale, self.coarse_scale))

    def unpack(self) -> ClusterIndex:
        """The index with fp32 centroids (new tensors for them; the rest shared)."""
        ix = self.index
        return ClusterIndex(**{**vars(ix), "fine_mu": dequantize(ix.fine_mu, self.fine_scale),
                               "coarse_mu": dequantize(ix.coarse_mu, self.coarse_scale), "fine_box": ix.fine_box.float()})


def empty_index(H: int, d: int, device, box: bool = False) -> ClusterIndex:
    """No chunk yet: one empty fine cluster under one empty coarse unit, for the first graft to fill (the own
    segment of a request whose whole prompt is an adopted prefix)."""
    def zeros(*shape):
        return torch.zeros(H, *shape, device=device)

    return ClusterIndex(zeros(1, d), zeros(1) + NEG_INF, zeros(1), zeros(1), zeros(1).long(), zeros(1, d),
                        zeros(1) + NEG_INF, zeros(1), zeros(1), zeros(0).long(), zeros(1, 2, d if box else 0))


def union(a: ClusterIndex, b: ClusterIndex) -> ClusterIndex:
    """One index over ``a``'s chunks then ``b``'s, as the kernels read a request's two segments: ``b``'s fine
    parents count from ``a``'s coarse units, its chunks' clusters from ``a``'s fine clusters."""
    offset = {"fine_parent": a.coarse_r.shape[1], "chunk_fine": a.fine_r.shape[1]}

    def cat(k, x, y):
        dtype = torch.promote_types(x.dtype, y.dtype)
        return torch.cat([x.to(dtype), y.to(dtype) + offset.get(k, 0)], 1)

    return ClusterIndex(**{k: cat(k, x, getattr(b, k)) for k, x in vars(a).items()})


def recount(index: ClusterIndex, lengths: torch.Tensor) -> ClusterIndex:
    """Chunk and token counts of every cluster from the index's chunks (``lengths``: tokens per chunk); a cluster
    left without a chunk is empty (radius -inf). In place."""
    H, L = index.fine_r.shape
    P = index.coarse_r.shape[1]
    ones = torch.ones(H, index.num_chunks, dtype=index.fine_n.dtype, device=index.fine_n.device)
    index.fine_n = scatter_sum(ones, index.chunk_fine, L)
    index.fine_tokens = scatter_sum(lengths.to(ones.dtype).expand(H, -1), index.chunk_fine, L)
    index.fine_r = index.fine_r.masked_fill(index.fine_n == 0, NEG_INF)
    index.coarse_n = scatter_sum(index.fine_n, index.fine_parent, P)
    index.coarse_tokens = scatter_sum(index.fine_tokens, index.fine_parent, P)
    return index


def cluster_counts(num_chunks: int, fine_cluster_size: float, max_coarse: int) -> tuple[int, int]:
    """L fine clusters (about ``fine_cluster_size`` chunks each) and P <= max_coarse coarse units (~sqrt L)."""
    L = max(1, min(num_chunks, math.ceil(num_chunks / fine_cluster_size)))
    P = max(1, min(max_coarse, L, math.ceil(math.sqrt(L))))
    return L, P


def _group_by_parent(fine_mu, fine_r, fine_n, fine_tokens, fine_parent, chunk_fine, fine_box):
    """Fine clusters reordered by coarse unit (stable), and chunk_fine renumbered to match: a step's live clusters
    (its expanded units' children) are then contiguous runs, and the fine-bounds kernel skips every block of rows
    without one."""
    order = torch.sort(fine_parent, dim=-1, stable=True).indices
    fine_mu = fine_mu.gather(1, order[..., None].expand(-1, -1, fine_mu.shape[-1]))
    fine_box = fine_box.gather(1, order[..., None, None].expand(-1, -1, *fine_box.shape[2:]))
    fine_r, fine_n, fine_tokens, fine_parent = (t.gather(1, order) for t in (fine_r, fine_n, fine_tokens, fine_parent))
    return (fine_mu, fine_r, fine_n, fine_tokens, fine_parent, torch.argsort(order, dim=-1).gather(1, chunk_fine),
            fine_box)


def _fine_level(keys: torch.Tensor, chunk_len: torch.Tensor, L: int, iters: int, chunk_box: torch.Tensor | None):
    """Chunks -> L fine clusters: (mu, r, chunk count, tokens) per cluster, each chunk's cluster, and each
    cluster's box over its chunks' boxes (``chunk_box`` [H, M, 2, d] key min and max; none: [H, L, 2, 0])."""
    H, M, d = keys.shape
    fine_mu, chunk_fine = spherical_kmeans(keys, L, iters)
    fine_mu = stored(fine_mu)
    dist = (keys - fine_mu.gather(1, chunk_fine[..., None].expand(-1, -1, d))).norm(dim=-1)
    L = fine_mu.shape[1]
    if chunk_box is None:
        fine_box = keys.new_zeros(H, L, 2, 0)
    else:
        at = chunk_fine[..., None].expand(-1, -1, d)
        lo = keys.new_full((H, L, d), float("inf")).scatter_reduce_(1, at, chunk_box[:, :, 0].float(), "amin")
        hi = keys.new_full((H, L, d), NEG_INF).scatter_reduce_(1, at, chunk_box[:, :, 1].float(), "amax")
        fine_box = box_from(lo, hi)
    return (fine_mu, scatter_max(dist, chunk_fine, L), scatter_sum(torch.ones_like(dist), chunk_fine, L),
            scatter_sum(chunk_len.to(keys.dtype).expand(H, -1), chunk_fine, L), chunk_fine, fine_box)


def _coarse_level(fine_mu, fine_r, fine_n, fine_tokens, chunk_fine, fine_box, P: int, iters: int) -> ClusterIndex:
    """Fine clusters -> P coarse units; the whole index, fine clusters grouped by coarse unit."""
    d = fine_mu.shape[-1]
    coarse_mu, fine_parent = spherical_kmeans(fine_mu, P, iters)
    coarse_mu = stored(coarse_mu)
    P = coarse_mu.shape[1]
    fine_mu, fine_r, fine_n, fine_tokens, fine_parent, chunk_fine, fine_box = _group_by_parent(
        fine_mu, fine_r, fine_n, fine_tokens, fine_parent, chunk_fine, fine_box)
    reach = (fine_mu - coarse_mu.gather(1, fine_parent[..., None].expand(-1, -1, d))).norm(dim=-1) + fine_r
    coarse_r = scatter_max(reach, fine_parent, P)  # empty fine clusters carry -inf
    coarse_n = scatter_sum(fine_n, fine_parent, P)
    coarse_tokens = scatter_sum(fine_tokens, fine_parent, P)
    return ClusterIndex(fine_mu, fine_r, fine_n, fine_tokens, fine_parent,
                        coarse_mu, coarse_r, coarse_n, coarse_tokens, chunk_fine, fine_box)


def build_index(keys: torch.Tensor, chunk_len: torch.Tensor, fine_cluster_size: float,
                max_coarse: int, iters: int, chunk_box: torch.Tensor | None = None) -> ClusterIndex:
    """keys: [H, M, d] unit chunk keys; chunk_len: [M] tokens per chunk; chunk_box: [H, M, 2, d] each chunk's key
    min and max, for fine boxes (``fine_bound`` "box")."""
    L, P = cluster_counts(keys.shape[1], fine_cluster_size, max_coarse)
    return _coarse_level(*_fine_level(keys, chunk_len, L, iters, chunk_box), P, iters)


def _in_head_groups(build, H: int, per_head: int, max_bytes: int) -> ClusterIndex:
    """``build(heads)`` over slices of the heads small enough that its temporaries stay under ``max_bytes``,
    concatenated (each head clusters on its own, so this is one call's result)."""
    group = max(1, min(H, max_bytes // max(1, per_head)))
    parts = [build(slice(h, h + group)) for h in range(0, H, group)]
    if len(parts) == 1:
        return parts[0]
    return ClusterIndex(**{k: torch.cat([vars(p)[k] for p in parts]) for k in vars(parts[0])})


def _bytes_per_head(keys: torch.Tensor, L: int) -> int:
    """On the CPU the chunk-to-centroid similarity matrix; on the GPU, which never forms it, a few copies of the
    keys."""
    return 4 * keys.shape[1] * (4 * keys.shape[2] if keys.is_cuda else L)


def build_index_grouped(keys: torch.Tensor, chunk_len: torch.Tensor, fine_cluster_size: float, max_coarse: int,
                        iters: int, max_bytes: int = 1 << 30, chunk_box: torch.Tensor | None = None) -> ClusterIndex:
    """``build_index`` over many heads (e.g. every layer's), a group of heads at a time."""
    L, _ = cluster_counts(keys.shape[1], fine_cluster_size, max_coarse)
    return _in_head_groups(lambda h: build_index(keys[h], chunk_len, fine_cluster_size, max_coarse, iters,
                                                 None if chunk_box is None else chunk_box[h]),
                           keys.shape[0], _bytes_per_head(keys, L), max_bytes)


def precompile_build(d: int, device, fine_cluster_size: float, max_coarse: int, iters: int) -> None:
    """Compile the k-means kernels of ``build_index_grouped`` now: eight made-up unit keys of width ``d``, a few
    clusters of them. The kernels do not specialize on chunk or cluster counts, so these variants serve every
    prompt; index placement runs inside a prefill, where a first compile (seconds on a fresh machine) would stall
    the batch."""
    n = 8
    build_index_grouped(torch.eye(n, d, device=device)[None], torch.ones(n, device=device), fine_cluster_size,
                        max_coarse, iters)


def graft(index: ClusterIndex, key: torch.Tensor, length, box: torch.Tensor | None = None) -> torch.Tensor:
    """Lazy update: add one chunk (``key`` [..., d]) to its nearest fine cluster, in place; returns that
    cluster [...]. With fine boxes, ``box`` [..., 2, d] is the chunk's key min and max, which the cluster's box
    grows to cover. Any leading head dims: [H] for one layer, or [Ls, H] of the index pools' rows
    (``IndexPools.view``, for ``kernels/graft.py``'s twin, which stores the centroids back); ``chunk_fine`` is left
    to the caller.

    Centroids move by running mean (``stored``); radii grow by the stored centroid's shift
    (so old members stay covered without being revisited) and to cover the new chunk.
    """
    def at(t, i):
        return t.gather(-1, i)

    def at_mu(t, i):
        return t.gather(-2, i[..., None].expand(*i.shape, t.shape[-1])).float()

    sim = torch.einsum("...ld,...d->...l", index.fine_mu.float(), key.float())
    sim = sim.masked_fill(index.fine_n == 0, NEG_INF)
    c = sim.argmax(-1, keepdim=True)                     # [..., 1]
    n_c = at(index.fine_n, c)
    mu_c = at_mu(index.fine_mu, c)
    new_mu_c = stored(mu_c + (key[..., None, :] - mu_c) / (n_c + 1)[..., None])
    shift_c = (new_mu_c - mu_c).norm(dim=-1) * (n_c > 0)   # an empty cluster has no member to keep covered
    old_r_c = at(index.fine_r, c).clamp_min(0)  # an empty cluster starts at radius 0
    new_r_c = torch.maximum(old_r_c + shift_c, (key[..., None, :] - new_mu_c).norm(dim=-1))
    index.fine_mu.scatter_(-2, c[..., None].expand_as(new_mu_c), new_mu_c.to(index.fine_mu.dtype))
    index.fine_r.scatter_(-1, c, new_r_c)
    index.fine_n.scatter_(-1, c, n_c + 1)
    index.fine_tokens.scatter_(-1, c, at(index.fine_tokens, c) + length)
    if index.has_box:
        fb = index.fine_box
        at_box = c[..., None, None].expand(*c.shape, *fb.shape[-2:])
        new_box = box_union(fb.gather(-3, at_box)[..., 0, :, :].float(), box[..., 0, :].float(),
                            box[..., 1, :].float(), n_c[..., 0] > 0)
        fb.scatter_(-3, at_box, new_box[..., None, :, :].to(fb.dtype))

    g = at(index.fine_parent, c).long()
    n_g = at(index.coarse_n, g)
    mu_g = at_mu(index.coarse_mu, g)
    new_mu_g = stored(mu_g + (key[..., None, :] - mu_g) / (n_g + 1)[..., None])
    shift_g = (new_mu_g - mu_g).norm(dim=-1) * (n_g > 0)
    old_r_g = at(index.coarse_r, g).clamp_min(0)
    reach = (new_mu_c - new_mu_g).norm(dim=-1) + new_r_c
    index.coarse_mu.scatter_(-2, g[..., None].expand_as(new_mu_g), new_mu_g.to(index.coarse_mu.dtype))
    index.coarse_r.scatter_(-1, g, torch.maximum(old_r_g + shift_g, reach))
    index.coarse_n.scatter_(-1, g, n_g + 1)
    index.coarse_tokens.scatter_(-1, g, at(index.coarse_tokens, g) + length)
    return c[..., 0]


def upper_bound(q: torch.Tensor, mu: torch.Tensor, r: torch.Tensor, reduce: str) -> torch.Tensor:
    """UB of every node for a GQA group. q: [H, G, d]; mu: [H, N, d]; r: [H, N] -> [H, N].

    ``max``: the largest bound over the group's query heads (a node matters if any head wants it);
    ``mean``: the bound of the group's mean query.
    """
    if reduce == "mean":
        q = q.mean(dim=1, keepdim=True)
    ub = torch.einsum("hgd,hnd->hgn", q, mu) + q.norm(dim=-1)[..., None] * r[:, None, :]
    return ub.amax(dim=1)


def box_bound(q: torch.Tensor, box: torch.Tensor, weight: float, reduce: str) -> torch.Tensor:
    """Ranking score of every fine box for a GQA group: q.c + weight |q|.w (weight 1: Quest's bound, the largest
    q.k over the box). q: [H, G, d]; box: [H, N, 2, d] -> [H, N]; ``reduce`` as in :func:`upper_bound`."""
    if reduce == "mean":
        q = q.mean(dim=1, keepdim=True)
    s = torch.einsum("hgd,hnd->hgn", q, box[..., 0, :]) + weight * torch.einsum("hgd,hnd->hgn", q.abs(), box[..., 1, :])
    return s.amax(dim=1)
