"""ClusterIndex objects laid out as the index pools store them, with the step table the selection kernels read:
the kernel benchmarks' and kernel tests' fixtures (serving loads indexes through ``IndexPools.load``)."""

from __future__ import annotations

import torch

from sgl_sparsekv.index import quantize, quantize_box
from sgl_sparsekv.kernels.select import (RANGE_FIELDS, Centroids, ChunkRows, CoarseRows, FineRows, RequestRanges,
                                         Segment)


def pack(indexes, chunk_starts, chunk_lens, device):
    """Per-request ClusterIndex objects packed into node pools.

    Returns (coarse, fine, chunks, ranges): pools in the layouts the kernels read, and ``ranges`` with each
    request's index as its own segment (segment 0 empty) and its scratch rows at its fine rows.
    """
    def cat(ts):
        return torch.cat(ts).to(device)

    def centroids(ts):   # stored as the index pools store them
        return Centroids(*(t.contiguous() for t in quantize(cat(ts))))

    columns = []
    c = f = k = 0
    for ix in indexes:
        P, L, M = ix.coarse_r.shape[1], ix.fine_r.shape[1], ix.chunk_fine.shape[1]
        columns.append(RequestRanges(Segment(), Segment(c, P, f, L, k, M), scratch_at=f).column())
        c, f, k = c + P, f + L, k + M
    table = torch.tensor(columns, dtype=torch.int32).reshape(len(indexes), len(RANGE_FIELDS)).T.contiguous()
    coarse = CoarseRows(centroids([ix.coarse_mu.transpose(0, 1) for ix in indexes]),
                        cat([ix.coarse_r.T for ix in indexes]).contiguous(),
                        cat([ix.coarse_tokens.T for ix in indexes]).contiguous())
    fine = FineRows(centroids([ix.fine_mu.transpose(0, 1) for ix in indexes]),
                    cat([ix.fine_r.T for ix in indexes]).contiguous(),
                    cat([ix.fine_tokens.T for ix in indexes]).contiguous(),
                    cat([ix.fine_parent.T for ix in indexes]).to(torch.int32).contiguous())
    chunks = ChunkRows(cat([ix.chunk_fine.T for ix in indexes]).to(torch.int32).contiguous(),
                       cat(list(chunk_starts)).to(torch.int32), cat(list(chunk_lens)).to(torch.int32))
    return coarse, fine, chunks, table.to(device)


def pack_box(indexes, device) -> torch.Tensor:
    """The fine boxes of :func:`pack`'s indexes as the index pools store them: [F, H, 2, d] bf16."""
    return quantize_box(torch.cat([ix.fine_box.transpose(0, 1) for ix in indexes])).contiguous().to(device)


def over_shared(packed: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """``pack``'s table for indexes [prefix, own_1, ..., own_n] as n requests that adopted the prefix (tests and
    benchmarks): batch row i reads the prefix's rows as segment 0 and own_{i+1} as segment 1; scratch rows one
    request after another from ``first_row``."""
    rows = [RequestRanges.of(c) for c in packed.T.tolist()]
    prefix, at, columns = rows[0].own, first_row, []
    for r in rows[1:]:
        columns.append(RequestRanges(prefix, r.own, at).column())
        at += prefix.fine + r.own.fine
    return torch.tensor(columns, dtype=torch.int32, device=packed.device).T.contiguous()
