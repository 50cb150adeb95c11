"""kernels/page_table.py: FlashInfer's page table written by many programs per request, against its torch twin and
SGLang's own one-program-per-request kernel, entry for entry (small shapes on CPU, real ones on the GPU)."""

import pytest
import torch

from sgl_sparsekv.kernels.page_table import BLOCK, PROGRAMS, PageTableWriter

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def page_table_torch(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, indptr: torch.Tensor,
                     start: torch.Tensor | None, out: torch.Tensor) -> None:
    """The kernel's torch twin: request by request."""
    for b in range(rows.numel()):
        s, n, o = (0 if start is None else int(start[b])), int(lens[b]), int(indptr[b])
        out[o:o + n] = req_to_token[int(rows[b]), s:s + n]


def check(lens: list[int], row_len: int, shifted: bool, seed: int = 0) -> None:
    from sglang.srt.layers.attention.triton_ops.kv_indices import create_flashinfer_kv_indices_triton

    gen = torch.Generator().manual_seed(seed)
    bs = len(lens)
    table = torch.randint(1, 1 << 30, (bs + 3, row_len), generator=gen, dtype=torch.int32).to(DEV)
    rows = torch.randperm(bs + 3, generator=gen)[:bs].to(DEV)   # int64, as SGLang's req_pool_indices
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = torch.cumsum(lens_t, 0)
    # a sliding window's range starts inside the row
    start = torch.tensor([row_len - n for n in lens], dtype=torch.int64, device=DEV) if shifted else None
    got, ref, sglang = (torch.zeros(sum(lens) + 7, dtype=torch.int32, device=DEV) for _ in range(3))
    PageTableWriter()[(bs,)](table, rows, lens_t, indptr, start, got, row_len)
    page_table_torch(table, rows, lens_t, indptr, start, ref)
    create_flashinfer_kv_indices_triton[(bs,)](table, rows, lens_t, indptr, start, sglang, row_len)
    assert torch.equal(got, ref) and torch.equal(got, sglang)
    assert not got[sum(lens):].any()   # nothing written past the batch's entries


@pytest.mark.parametrize("shifted", [False, True])
def test_page_table_small(shifted):
    """Lengths around a block and past one pass of every program (a program takes several blocks)."""
    check([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, BLOCK * PROGRAMS + 5], BLOCK * PROGRAMS + 40, shifted)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[126_976], [32_768] * 16, [4_096, 130_000, 1, 65_536]])
@pytest.mark.parametrize("shifted", [False, True])
def test_page_table_real_shapes(lens, shifted):
    check(lens, 131_072, shifted, seed=len(lens))


def test_gpu_backends_get_the_writer_only_for_sglangs_kernel(monkeypatch):
    """patches/backend.py replaces the kernel in the wrapped backend's module where it takes SGLang 0.5.15's
    parameters (as flashinfer's and triton's backends import it), once; another kernel stays."""
    import sys
    import types

    import triton

    from sgl_sparsekv.patches.backend import PAGE_TABLE_KERNEL, write_page_tables_wide
    from sglang.srt.layers.attention.triton_ops.kv_indices import create_flashinfer_kv_indices_triton

    @triton.jit
    def other(a, b):
        pass

    for kernel, replaced in ((create_flashinfer_kv_indices_triton, True), (other, False)):
        module = types.ModuleType("fake_backend_module")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        backend = type("FakeBackend", (), {"__module__": module.__name__})()
        setattr(module, PAGE_TABLE_KERNEL, kernel)
        write_page_tables_wide(backend)
        writer = getattr(module, PAGE_TABLE_KERNEL)
        assert isinstance(writer, PageTableWriter) == replaced
        write_page_tables_wide(backend)   # a second backend in the process
        assert getattr(module, PAGE_TABLE_KERNEL) is writer
