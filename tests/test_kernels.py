"""Every Triton kernel against its torch twin: small shapes on CPU (TRITON_INTERPRET=1), real shapes on GPU."""

import pytest
import torch

from sgl_sparsekv.kernels.kmeans import cluster_sums, cluster_sums_ref, nearest_centroid, nearest_centroid_ref
from sgl_sparsekv.kernels.pool import pool_units, pool_units_layers, pool_units_ref
from sgl_sparsekv.kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter has no bf16 arithmetic of its own; fp16 exercises the same code on CPU
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def make_lists(bs, H, num_slots, lens, gen):
    lens = torch.as_tensor(lens).flatten()
    indptr = torch.zeros(bs * H + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    # distinct slots per list, like a real selection
    parts = [torch.randperm(num_slots - 1, generator=gen)[:int(n)] + 1 for n in lens]
    indices = torch.cat(parts + [torch.zeros(7, dtype=torch.long)]).to(torch.int32)
    return indptr.to(DEV), indices.to(DEV)


def run_decode_case(bs, H, G, D, lens, num_slots, splits, seed=0, kv_dtype=DTYPE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, H * G, D, generator=gen).to(DEV, DTYPE)
    k = torch.randn(num_slots, H, D, generator=gen).to(DEV, kv_dtype)
    v = torch.randn(num_slots, H, D, generator=gen).to(DEV, kv_dtype)
    indptr, indices = make_lists(bs, H, num_slots, lens, gen)
    out = torch.full_like(q, float("nan"))
    sparse_decode_attention(q, k, v, indptr, indices, D ** -0.5, out=out, num_splits=splits)
    ref = sparse_decode_attention_ref(q, k, v, indptr, indices, D ** -0.5)
    assert not torch.isnan(out).any(), "unwritten output"
    assert rel_err(out, ref) < 1e-2, (bs, H, G, D, splits)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3, 4, 7])
def test_sparse_decode_small(D, G):
    gen = torch.Generator().manual_seed(G)
    bs, H = 2, 2
    lens = torch.randint(1, 90, (bs, H), generator=gen)
    lens[0, 1] = 200  # one head longer than the others (a dense retrieval head later)
    run_decode_case(bs, H, G, D, lens, 400, splits=3, seed=D + G)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_sparse_decode_fp8_kv(kv_dtype):
    """fp8 KV (--kv-cache-dtype fp8_*): the kernel dequantizes on load, attending as the twin does over the same
    fp8 values in fp32."""
    run_decode_case(2, 2, 4, 64, [[40, 130], [1, 77]], 300, splits=3, seed=3, kv_dtype=kv_dtype)


def test_sparse_decode_empty_list_and_single_token():
    run_decode_case(1, 2, 4, 64, [[0, 1]], 50, splits=4)


def test_budget_larger_and_smaller_than_sequence():
    """A list that covers the whole sequence is exactly dense attention over it."""
    gen = torch.Generator().manual_seed(1)
    seq, H, G, D = 100, 2, 3, 64
    q = torch.randn(1, H * G, D, generator=gen).to(DEV, DTYPE)
    k = torch.randn(seq + 1, H, D, generator=gen).to(DEV, DTYPE)
    v = torch.randn(seq + 1, H, D, generator=gen).to(DEV, DTYPE)
    slots = torch.arange(1, seq + 1, dtype=torch.int32)
    for budget in (seq + 50, 40):
        n = min(budget, seq)
        indptr = torch.tensor([0, n, 2 * n], dtype=torch.int32, device=DEV)
        indices = torch.cat([slots[:n], slots[seq - n:]]).to(DEV)
        out = sparse_decode_attention(q, k, v, indptr, indices, D ** -0.5, num_splits=2)
        ref = sparse_decode_attention_ref(q, k, v, indptr, indices, D ** -0.5)
        assert rel_err(out, ref) < 1e-2
    dense = torch.softmax((q[0].float().view(H, G, D) @ k[1:].float().transpose(0, 1).transpose(1, 2)) * D ** -0.5, -1)
    dense = (dense @ v[1:].float().transpose(0, 1)).reshape(H * G, D)
    indptr = torch.tensor([0, seq, 2 * seq], dtype=torch.int32, device=DEV)
    out = sparse_decode_attention(q, k, v, indptr, torch.cat([slots, slots]).to(DEV), D ** -0.5, num_splits=2)
    assert rel_err(out[0], dense) < 1e-2


def run_direct_case(seqs, num_slots, splits, G=4, D=64, H=2, seed=0, tail=False):
    """Requests flagged direct attend to their whole req_to_token row; the others to their lists (and, with
    ``tail``, to their row's positions from ``tail_from`` on: lists reused from an earlier step, at list rows
    other than their batch rows)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(seqs)
    q = torch.randn(bs, H * G, D, generator=gen).to(DEV, DTYPE)
    k = torch.randn(num_slots, H, D, generator=gen).to(DEV, DTYPE)
    v = torch.randn(num_slots, H, D, generator=gen).to(DEV, DTYPE)
    indptr, indices = make_lists(bs, H, num_slots, torch.randint(1, 40, (bs, H), generator=gen), gen)
    req_to_token = torch.randint(1, num_slots, (bs + 2, max(seqs) + 5), generator=gen, dtype=torch.int32).to(DEV)
    rows = torch.arange(bs, 0, -1, dtype=torch.int32, device=DEV)   # not the batch order
    flags = torch.tensor([i % 2 for i in range(bs)], dtype=torch.int32, device=DEV)
    direct = (flags, rows, torch.tensor(seqs, dtype=torch.int32, device=DEV), req_to_token)
    tail_from = [max(0, S - int(torch.randint(0, 9, (1,), generator=gen))) for S in seqs]
    list_rows = None
    if tail:
        direct += (torch.tensor(tail_from, dtype=torch.int32, device=DEV),)
        list_rows = torch.arange(bs - 1, -1, -1, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    sparse_decode_attention(q, k, v, indptr, indices, D ** -0.5, out=out, num_splits=splits, direct=direct,
                            list_rows=list_rows)
    ref = sparse_decode_attention_ref(q, k, v, indptr, indices, D ** -0.5, direct=direct, list_rows=list_rows)
    assert not torch.isnan(out).any(), "unwritten output"
    assert rel_err(out, ref) < 1e-2
    # a direct request's output is plain attention over its row, whatever its list held
    b = 1
    row = req_to_token[int(rows[b]), :seqs[b]].long()
    for h in range(H):
        p = torch.softmax(q[b, h * G:(h + 1) * G].float() @ k[row, h].float().T * D ** -0.5, -1)
        assert rel_err(out[b, h * G:(h + 1) * G], p @ v[row, h].float()) < 1e-2
    # a request with a tail attends to its list and then its row's positions tail_from .. seq_len
    b = 0
    lr = bs - 1 if tail else b
    lst = indices[int(indptr[lr * H]):int(indptr[lr * H + 1])].long()
    slots = torch.cat([lst, req_to_token[int(rows[b]), tail_from[b] if tail else seqs[b]:seqs[b]].long()])
    p = torch.softmax(q[b, :G].float() @ k[slots, 0].float().T * D ** -0.5, -1)
    assert rel_err(out[b, :G], p @ v[slots, 0].float()) < 1e-2
    assert not tail or any(t < S for t, S in zip(tail_from[::2], seqs[::2])), "no tail exercised"


@pytest.mark.parametrize("tail", [False, True])
def test_sparse_decode_direct_rows(tail):
    run_direct_case([30, 150, 7, 260], 400, splits=3, tail=tail)


def test_sparse_decode_ring_tail():
    """The host tier's tail: each request's list, then its positions tail_from .. seq_len at the rows of its ring
    (first row rows[b], position p at rows[b] + p % R), across the ring's wrap; req_to_token is not read."""
    gen = torch.Generator().manual_seed(5)
    bs, H, G, D, R = 4, 2, 4, 64, 24
    num_slots = 200
    q = torch.randn(bs, H * G, D, generator=gen).to(DEV, DTYPE)
    k = torch.randn(num_slots, H, D, generator=gen).to(DEV, DTYPE)
    v = torch.randn(num_slots, H, D, generator=gen).to(DEV, DTYPE)
    indptr, indices = make_lists(bs, H, num_slots, torch.randint(1, 40, (bs, H), generator=gen), gen)
    seqs, tail_from, ring_at = [50, 73, 24, 9], [45, 70, 24, 2], [10, 60, 110, 150]   # 70 .. 72 wraps at 72
    direct = tuple(torch.tensor(x, dtype=torch.int32, device=DEV) for x in ([0] * bs, ring_at, seqs))
    direct = (*direct[:3], torch.full((1, 1), -1, dtype=torch.int32, device=DEV),
              torch.tensor(tail_from, dtype=torch.int32, device=DEV))
    list_rows = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    sparse_decode_attention(q, k, v, indptr, indices, D ** -0.5, out=out, num_splits=3, direct=direct,
                            list_rows=list_rows, tail_ring=R)
    ref = sparse_decode_attention_ref(q, k, v, indptr, indices, D ** -0.5, direct=direct, list_rows=list_rows,
                                      tail_ring=R)
    assert not torch.isnan(out).any(), "unwritten output"
    assert rel_err(out, ref) < 1e-2
    for b in range(bs):   # brute force: the slots written out
        for h in range(H):
            li = int(list_rows[b]) * H + h
            lst = indices[int(indptr[li]):int(indptr[li + 1])].long().cpu()
            ring = torch.tensor([ring_at[b] + p % R for p in range(tail_from[b], seqs[b])], dtype=torch.long)
            slots = torch.cat([lst, ring]).to(DEV)
            p = torch.softmax(q[b, h * G:(h + 1) * G].float() @ k[slots, h].float().T * D ** -0.5, -1)
            assert rel_err(out[b, h * G:(h + 1) * G], p @ v[slots, h].float()) < 1e-2, (b, h)


@pytest.mark.parametrize("minmax", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_pool_units(minmax, D):
    gen = torch.Generator().manual_seed(D)
    k = torch.randn(300, 3, D, generator=gen).to(DEV, DTYPE)
    lens = torch.randint(1, 20, (25,), generator=gen)
    indptr = torch.zeros(26, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    slots = torch.randint(1, 300, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    out = pool_units(k, slots.to(DEV), indptr.to(DEV), minmax)
    ref = pool_units_ref(k, slots.to(DEV), indptr.to(DEV), minmax)
    assert rel_err(out, ref) < 1e-4


def check_pool_units_layers(layers, slots_n, units, D, minmax, seed, kv_dtype=DTYPE):
    """The all-layer launch writes into a unit store exactly what pool_units gives per layer."""
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(slots_n, 3, D, generator=gen).to(DEV, kv_dtype) for _ in range(layers)]
    lens = torch.randint(1, 20, (units,), generator=gen)
    indptr = torch.zeros(units + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    slots = torch.randint(1, slots_n, (int(indptr[-1]),), generator=gen, dtype=torch.int32).to(DEV)
    uids = torch.randperm(2 * units, generator=gen)[:units].to(DEV)
    vecs = 2 if minmax else 1
    store = torch.zeros(layers, 2 * units, 3, vecs, D, dtype=torch.bfloat16, device=DEV)
    ptrs = torch.tensor([k.data_ptr() for k in ks], dtype=torch.int64, device=DEV)
    pool_units_layers(ptrs, ks[0], slots, indptr.to(DEV), uids, store, minmax)
    for l, k in enumerate(ks):
        want = pool_units_ref(k, slots, indptr.to(DEV), minmax).view(units, 3, vecs, D)
        assert rel_err(store[l, uids].float(), want) < 1e-2, l
    untouched = torch.ones(2 * units, dtype=torch.bool, device=DEV)
    untouched[uids] = False
    assert not store[:, untouched].any()


@pytest.mark.parametrize("minmax", [False, True])
def test_pool_units_all_layers_in_one_launch(minmax):
    check_pool_units_layers(3, 300, 25, 64, minmax, seed=4)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_pool_units_all_layers_fp8_kv(kv_dtype):
    check_pool_units_layers(2, 200, 12, 64, True, seed=6, kv_dtype=kv_dtype)


def check_nearest_centroid(H, N, K, D, seed):
    """The kernel's choice is a nearest centroid (up to TF32 rounding on near-ties); exact ties go to the first."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(H, N, D, generator=gen), dim=-1)
    c = torch.nn.functional.normalize(torch.randn(H, K, D, generator=gen), dim=-1)
    c[:, K - 1] = c[:, 1]        # a duplicate centroid in a later tile: its points must go to index 1
    x[:, 0] = c[:, 1]
    x, c = x.to(DEV), c.to(DEV)
    got = nearest_centroid(x, c)
    ref = nearest_centroid_ref(x, c)
    sim = torch.einsum("hnd,hkd->hnk", x, c)
    best = sim.gather(2, ref[..., None]).squeeze(-1)
    chosen = sim.gather(2, got[..., None]).squeeze(-1)
    assert got.dtype == torch.int64 and got.shape == (H, N)
    assert (chosen >= best - 2e-3).all()
    assert (got == ref).float().mean() > 0.99
    assert (got[:, 0] == 1).all()


def check_cluster_sums(H, N, K, D, seed):
    """Sums and sizes equal scatter_add's; empty clusters sum to zero; two runs agree to the bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(H, N, D, generator=gen).to(DEV)
    assign = torch.randint(0, K - 1, (H, N), generator=gen).to(DEV)   # cluster K - 1 stays empty
    sums, counts = cluster_sums(x, assign, K)
    want_sums, want_counts = cluster_sums_ref(x, assign, K)
    assert torch.equal(counts, want_counts) and counts.dtype == x.dtype
    assert torch.allclose(sums, want_sums, atol=1e-4, rtol=1e-5)
    assert not sums[:, K - 1].any()
    assert torch.equal(cluster_sums(x, assign, K)[0], sums)


@pytest.mark.parametrize("D", [64, 128])
def test_nearest_centroid(D):
    check_nearest_centroid(3, 150, 70, D, seed=D)


@pytest.mark.parametrize("D", [64, 128])
def test_cluster_sums(D):
    check_cluster_sums(3, 150, 40, D, seed=D)


@pytest.mark.gpu
def test_kmeans_steps_real_shapes():
    """Every sparse layer's heads of a 32K prompt at once (30 x 8 heads, 2730 chunks, 1365 fine clusters)."""
    check_nearest_centroid(240, 2730, 1365, 128, seed=1)
    check_cluster_sums(240, 2730, 1365, 128, seed=2)


@pytest.mark.gpu
def test_index_build_is_deterministic_on_the_gpu():
    """The same keys give the same index twice (TF32 assignment would amplify unordered float sums)."""
    from sgl_sparsekv.index import build_index_grouped

    gen = torch.Generator().manual_seed(3)
    keys = torch.nn.functional.normalize(torch.randn(24, 3000, 128, generator=gen), dim=-1).to(DEV)
    lens = torch.randint(8, 17, (3000,), generator=gen).to(DEV)
    a, b = (build_index_grouped(keys, lens, 2.0, 64, 10) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 32])
@pytest.mark.parametrize("G,D", [(4, 128), (7, 128), (3, 64)])
def test_sparse_decode_real_shapes(bs, G, D):
    H = 8 if G != 7 else 4
    gen = torch.Generator().manual_seed(bs)
    lens = torch.randint(900, 1025, (bs, H), generator=gen)
    run_decode_case(bs, H, G, D, lens, 200_000, splits=8, seed=bs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
def test_sparse_decode_fp8_kv_real_shapes(kv_dtype):
    gen = torch.Generator().manual_seed(9)
    run_decode_case(16, 8, 4, 128, torch.randint(900, 1025, (16, 8), generator=gen), 200_000, splits=8, seed=9,
                    kv_dtype=kv_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [False, True])
def test_sparse_decode_direct_rows_real_shapes(tail):
    run_direct_case([1000, 33_000, 4096, 65_000], 140_000, splits=8, G=4, D=128, H=8, tail=tail)


@pytest.mark.gpu
def test_pool_units_all_layers_real_shapes():
    """30 key buffers of 140K slots, 8 heads x 128: what a decode step summarizes for every sparse layer."""
    check_pool_units_layers(30, 140_000, 64, 128, False, seed=5)
    check_pool_units_layers(30, 140_000, 64, 128, True, seed=7, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu
def test_pool_units_real_shapes():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(140_000, 8, 128, generator=gen).to(DEV, DTYPE)
    lens = torch.randint(8, 17, (10_000,), generator=gen)
    indptr = torch.zeros(10_001, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    slots = torch.randperm(139_999, generator=gen)[:int(indptr[-1])].to(torch.int32) + 1
    for minmax in (False, True):
        out = pool_units(k, slots.to(DEV), indptr.to(DEV), minmax)
        assert rel_err(out, pool_units_ref(k, slots.to(DEV), indptr.to(DEV), minmax)) < 1e-4
