"""SGLang's FlashInfer page table of a batch (``kv_indices``), written by many programs per request.

    req_to_token [rows, row_len] int32   SGLang's token table
    rows [bs]                            each request's row in it
    lens [bs]                            entries per request
    indptr [bs + 1] int32                request b's entries start at indptr[b]
    start [bs] or None                   the first token of each request's range (None: 0)
-> out[indptr[b] + i] = req_to_token[rows[b], start[b] + i] for i < lens[b]

SGLang's own kernel (``create_flashinfer_kv_indices_triton``) runs one program per request, which copies the row
512 entries at a time, one block after another: at batch 1 and 126K tokens 248 blocks in a row on one SM, between
two graph replays of every decode step. Here ``PROGRAMS`` programs per request take every ``PROGRAMS``-th block.
:class:`PageTableWriter` stands in for SGLang's kernel object where the sparse backend wraps FlashInfer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512
PROGRAMS = 32


@triton.jit
def _page_table_kernel(ReqToToken, Rows, Lens, Indptr, Start, Out, stride, HAS_START: tl.constexpr,
                       PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    p = tl.program_id(1)
    row = tl.load(Rows + b).to(tl.int64)
    out = Out + tl.load(Indptr + b).to(tl.int64)
    n = tl.load(Lens + b).to(tl.int64)
    src = ReqToToken + row * stride
    if HAS_START:
        src += tl.load(Start + b).to(tl.int64)
    for blk in range(p * BLOCK, n, PROGRAMS * BLOCK):
        offs = blk + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)


def write_page_table(bs: int, req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                     indptr: torch.Tensor, start: torch.Tensor | None, out: torch.Tensor, stride: int) -> None:
    """SGLang's kernel's arguments, in its order; ``stride``: the token table's row length."""
    _page_table_kernel[(bs, PROGRAMS)](req_to_token, rows, lens, indptr, lens if start is None else start, out,
                                       stride, HAS_START=start is not None, PROGRAMS=PROGRAMS, BLOCK=BLOCK)


class PageTableWriter:
    """``writer[(bs,)](*args)``, as SGLang launches its kernel."""

    def __getitem__(self, grid):
        def launch(*args):
            write_page_table(grid[0], *args)
        return launch
