"""The index pools' selection and grafting in plain torch: the algorithm (``select.select_clusters``,
``index.graft``) run on each request's rows of the pools. The CPU path runs these; tests compare the Triton kernels
of ``sgl_sparsekv.kernels`` (which import nothing of this package) with them."""

from __future__ import annotations

import torch

from sgl_sparsekv.index import ClusterIndex, dequantize, graft
from sgl_sparsekv.kernels.select import CUT_BLOCK, scratch_rows, batch_ranges, scratch, union_rows
from sgl_sparsekv.select import select_clusters


def select_fine_ref(q, coarse, fine, ranges, budget, expand: float, max_coarse: int = 64, parts: int = 8,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None, cut_block: int = CUT_BLOCK,
                    radius_weight: float = 1.0, heads: torch.Tensor | None = None, box=None):
    """Torch twin of ``kernels.select.select_fine``: ``select.select_clusters`` on each request's union of pool rows. A node
    is live where its radius is finite, as the kernels read it."""
    (cmu, csc), cr, ctok = coarse
    (fmu, fsc), fr, ftok, fpar = fine
    bs, Hq, D = q.shape
    H = cmu.shape[1]
    sel = out[1] if out is not None else scratch(scratch_rows(ranges, bs), H, q.device)[1]
    hs = slice(None) if heads is None else heads.long()
    for b, (r, B) in enumerate(zip(batch_ranges(ranges, bs), budget.tolist())):
        c, f = union_rows(r, "coarse").to(q.device), union_rows(r, "fine").to(q.device)
        par = fpar[f].long()
        par[r.prefix.fine:] += r.prefix.coarse
        view = ClusterIndex(fine_mu=dequantize(fmu[f], fsc[f]).transpose(0, 1), fine_r=fr[f].T,
                            fine_n=(fr[f].T > float("-inf")).float(), fine_tokens=ftok[f].T, fine_parent=par.T,
                            coarse_mu=dequantize(cmu[c], csc[c]).transpose(0, 1),
                            coarse_r=cr[c].T, coarse_n=(cr[c].T > float("-inf")).float(), coarse_tokens=ctok[c].T,
                            chunk_fine=par[:0].T,
                            fine_box=None if box is None else box[f].float().transpose(0, 1))
        cols = slice(r.scratch_at, r.scratch_at + len(f))
        sel[hs, cols] = select_clusters(view, q[b].float().view(H, Hq // H, D), B, expand, "max",
                                        radius_weight).float()[hs]
    return sel


def graft_chunks_ref(pools, keys: torch.Tensor, jobs: torch.Tensor, lengths: torch.Tensor,
                     starts: torch.Tensor) -> None:
    """Torch twin of ``kernels.graft.graft_chunks``: ``index.graft`` on [layers, heads] views of each request's rows."""
    for k0, count, f0, L, c0, row0 in jobs.T.tolist():
        view = pools.view(c0, f0, L)
        for i in range(count):
            kr, row = k0 + i, row0 + i
            pools.chunk_start[row] = starts[kr]
            pools.chunk_len[row] = lengths[kr]
            box = keys[:, kr, :, 1:].float() if pools.box else None
            pools.chunk_fine[:, row] = graft(view, keys[:, kr, :, 0].float(), float(lengths[kr]), box)
        pools.store_view(view, c0, f0)
