"""Decode-time selection: which tokens each KV head attends to at one step.

The rule, shared by the torch reference here and the Triton kernels:

1. Always: the first ``sink_tokens`` tokens and the last ``recent_window`` tokens (these hold the
   not-yet-indexed tail). The rest of the budget, ``B``, goes to retrieved units.
2. lychee: rank coarse units by their upper bound; expand them in that order until the expanded
   units hold ``coarse_expand * B`` tokens, and at least ``coarse_expand_min`` (``SparseKVConfig.expansion``
   gives the factor that says both; callers pass it as ``coarse_expand``). Rank the fine clusters of the
   expanded units by their bound and take them in order while the running token count stays <= ``B``
   (stop at the first that would overflow). All chunks of the taken clusters are attended.
   quest: score each page with sum_i max(q_i min_i, q_i max_i) and take the best ``B // page`` pages.
3. Ties break by lower index (stable sort), so the reference and the kernels agree.
"""

from __future__ import annotations

import torch

from sgl_sparsekv.index import NEG_INF, ClusterIndex, box_bound, upper_bound


def _prefix_within(sizes_sorted: torch.Tensor, valid_sorted: torch.Tensor, budget: float) -> torch.Tensor:
    """Take sorted items while the running size stays within ``budget``; invalid items end the run."""
    csum = torch.cumsum(torch.where(valid_sorted, sizes_sorted, torch.full_like(sizes_sorted, float("inf"))), dim=-1)
    return csum <= budget


def select_clusters(index: ClusterIndex, q: torch.Tensor, budget: int, coarse_expand: float,
                    reduce: str, radius_weight: float = 1.0) -> torch.Tensor:
    """Fine clusters to attend: bool [H, L]. q: [H, G, d] the layer's query heads per KV head.

    ``radius_weight`` scales the radius term of every bound: 1 ranks by the upper bound, 0 by the centroid's
    score alone (config key ``radius_weight``); with fine boxes it scales their half-widths alike."""
    H, L = index.fine_r.shape
    if not torch.is_tensor(budget) and budget <= 0:   # a tensor budget [H, 1] (one per head) is analysis only
        return torch.zeros(H, L, dtype=torch.bool, device=q.device)

    def weighted(r):   # empty nodes keep their -inf
        return r if radius_weight == 1 else torch.where(torch.isfinite(r), radius_weight * r, r)

    ub_g = upper_bound(q, index.coarse_mu, weighted(index.coarse_r), reduce)
    ub_g = ub_g.masked_fill(index.coarse_n == 0, NEG_INF)
    order = torch.sort(ub_g, dim=-1, descending=True, stable=True).indices
    tok = index.coarse_tokens.gather(1, order)
    before = torch.cumsum(tok, dim=-1) - tok
    expand_sorted = (before < coarse_expand * budget) & torch.isfinite(ub_g.gather(1, order))
    expanded = torch.zeros_like(expand_sorted).scatter_(1, order, expand_sorted)

    if index.has_box:
        ub_c = box_bound(q, index.fine_box, radius_weight, reduce)
    else:
        ub_c = upper_bound(q, index.fine_mu, weighted(index.fine_r), reduce)
    live = expanded.gather(1, index.fine_parent) & (index.fine_n > 0)
    ub_c = ub_c.masked_fill(~live, NEG_INF)
    order = torch.sort(ub_c, dim=-1, descending=True, stable=True).indices
    take_sorted = _prefix_within(index.fine_tokens.gather(1, order), live.gather(1, order), budget)
    return torch.zeros_like(take_sorted).scatter_(1, order, take_sorted)


def select_chunks(index: ClusterIndex, q: torch.Tensor, budget: int, coarse_expand: float,
                  reduce: str, radius_weight: float = 1.0) -> torch.Tensor:
    """Chunks to attend: bool [H, M]."""
    fine = select_clusters(index, q, budget, coarse_expand, reduce, radius_weight)
    return fine.gather(1, index.chunk_fine)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, reduce: str) -> torch.Tensor:
    """q: [H, G, d]; kmin/kmax: [H, N, d] per-page key bounds -> [H, N] page scores."""
    if reduce == "mean":
        q = q.mean(dim=1, keepdim=True)
    qe = q[:, :, None, :]
    s = torch.maximum(qe * kmin[:, None], qe * kmax[:, None]).sum(-1)
    return s.amax(dim=1)


def select_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, budget: int, page_size: int,
                 reduce: str) -> torch.Tensor:
    """Quest pages to attend: bool [H, N]."""
    H, N, _ = kmin.shape
    k = min(N, max(0, budget // page_size))
    sel = torch.zeros(H, N, dtype=torch.bool, device=q.device)
    if k == 0:
        return sel
    order = torch.sort(quest_scores(q, kmin, kmax, reduce), dim=-1, descending=True, stable=True).indices
    return sel.scatter_(1, order[:, :k], True)


def units_to_token_mask(unit_sel: torch.Tensor, unit_start: torch.Tensor, unit_end: torch.Tensor,
                        seq_len: int, sink: int, recent: int) -> torch.Tensor:
    """bool [H, seq_len]: sink + recent window + every token of the selected units."""
    H = unit_sel.shape[0]
    mask = torch.zeros(H, seq_len + 1, dtype=torch.int32, device=unit_sel.device)
    sel = unit_sel.to(torch.int32)
    # +1 at each selected unit's start, -1 at its end, prefix sum = coverage
    mask.scatter_add_(1, unit_start.expand(H, -1), sel)
    mask.scatter_add_(1, unit_end.expand(H, -1), -sel)
    out = torch.cumsum(mask, dim=1)[:, :seq_len] > 0
    out[:, :sink] = True
    out[:, max(0, seq_len - recent):] = True
    return out
