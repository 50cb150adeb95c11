"""The two-stage selection (config ``rerank_factor``): the rerank kernels against their torch twin and a brute
force, and the serving path against the analysis that measured it (``bench.attention_recall``'s lychee-rerank)."""

import pytest
import torch

from sgl_sparsekv.kernels.rerank import rerank_tokens, rerank_tokens_ref, workspace_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def candidate_batch(bs, H, G, D, S, n_lists, cap_c, gen, dtype=torch.float32, integer=False):
    """Random keys in a KV buffer, one candidate list per (request, KV head) laid out [sink | middle | recent] over
    distinct slots, of the lengths ``n_lists`` [bs][H]. ``integer``: small integer queries and keys, so logits are
    exact and equal keys tie exactly."""
    slots = 4 * bs * cap_c
    if integer:
        k = torch.randint(-2, 3, (slots, H, D), generator=gen).float()
        k[1::3] = k[0::3][:len(k[1::3])]          # every third key repeats its neighbour's: exact ties
        q = torch.randint(-1, 2, (bs, H * G, D), generator=gen).float()
    else:
        k = torch.randn(slots, H, D, generator=gen)
        q = torch.randn(bs, H * G, D, generator=gen)
    lens = torch.zeros(bs * H, dtype=torch.int32)
    windows = torch.zeros(bs * H * cap_c, dtype=torch.int32)
    for b in range(bs):
        for h in range(H):
            i, n = b * H + h, n_lists[b][h]
            windows[i * cap_c:i * cap_c + n] = torch.randperm(slots, generator=gen)[:n].int()
            lens[i] = n
    seq = torch.tensor(S, dtype=torch.int32)
    return q.to(dtype), k.to(dtype), (lens, windows), seq


def brute_force(q, k, cand, seq, scale, sink, recent, keep, dense_limit, b, h):
    """The kept slots of list (b, h) as a set: sink, recent window and the ``keep`` middle entries of largest
    group attention over the candidates (mean of the query heads' softmax)."""
    lens, windows = cand
    H = k.shape[1]
    G = q.shape[1] // H
    cap_c = windows.numel() // lens.numel()
    i = b * H + h
    n, S = int(lens[i]), int(seq[b])
    lst = windows[i * cap_c:i * cap_c + n].long()
    if S <= dense_limit:
        return set(lst.tolist())
    w = torch.softmax(q[b, h * G:(h + 1) * G].double() @ k[lst, h].double().T * scale, -1).mean(0)
    n_sink, n_rec = min(sink, S), min(recent, S - sink)
    mid = torch.arange(n_sink, n - n_rec)
    best = mid[w[mid].topk(min(keep, len(mid))).indices]
    return set(lst[:n_sink].tolist()) | set(lst[best].tolist()) | set(lst[n - n_rec:].tolist())


def run_both(q, k, cand, seq, sink, recent, keep, cap, dense_limit, heads=None):
    bs, H = q.shape[0], k.shape[1]
    cap_c = cand[1].numel() // cand[0].numel()
    outs = []
    for fn in (rerank_tokens, rerank_tokens_ref):
        out = (torch.full((bs * H,), -1, dtype=torch.int32, device=DEV),
               torch.full((bs * H * cap,), -1, dtype=torch.int32, device=DEV))
        ws = workspace_for(bs, H, q.shape[1] // H, cap_c, DEV)
        fn(q.to(DEV), k.to(DEV), tuple(x.to(DEV) for x in cand), seq.to(DEV), 0.125, sink, recent, keep, cap,
           dense_limit, out, ws, None if heads is None else torch.tensor(heads, dtype=torch.int32, device=DEV))
        outs.append(tuple(x.cpu() for x in out))
    return outs


def lists(out, bs, H, cap):
    lens, windows = out
    return [windows[i * cap:i * cap + int(lens[i])].tolist() if int(lens[i]) >= 0 else None for i in range(bs * H)]


@pytest.mark.parametrize("G,D", [(1, 64), (4, 64), (7, 128)])
def test_rerank_matches_twin_and_brute_force(G, D):
    """Three requests: one within the dense limit (its whole sequence is its list: all kept), one whose middle is
    shorter than ``keep`` (all kept), one with three times ``keep`` candidates. The kernel and the twin write the same
    lists, entry for entry, and keep what a brute-force top-k keeps."""
    sink, recent, keep = 4, 8, 10
    cap, cap_c = sink + recent + keep, sink + recent + 3 * keep
    gen = torch.Generator().manual_seed(G * 100 + D)
    bs, H = 3, 2
    n_lists = [[15, 15], [sink + recent + 6, sink + recent + 9], [cap_c, cap_c - 5]]
    q, k, cand, seq = candidate_batch(bs, H, G, D, [15, 300, 500], n_lists, cap_c, gen)
    got, ref = run_both(q, k, cand, seq, sink, recent, keep, cap, dense_limit=cap)
    assert lists(got, bs, H, cap) == lists(ref, bs, H, cap)
    for b in range(bs):
        for h in range(H):
            lst = lists(ref, bs, H, cap)[b * H + h]
            assert len(lst) == min(n_lists[b][h], cap)
            assert set(lst) == brute_force(q, k, cand, seq, 0.125, sink, recent, keep, cap, b, h)
            i = b * H + h
            order = cand[1][i * cap_c:(i + 1) * cap_c].tolist()
            assert lst == sorted(lst, key=order.index)   # list order kept: sink first, recent last


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rerank_reads_fp8_keys(kv_dtype):
    """fp8 KV: small integer keys are exact in fp8, so the kernel and the twin over the fp8 buffer keep exactly the
    lists they keep over the same keys in fp32."""
    sink, recent, keep = 2, 4, 7
    cap, cap_c = sink + recent + keep, sink + recent + 3 * keep
    gen = torch.Generator().manual_seed(8)
    bs, H, G, D = 2, 2, 4, 32
    q, k, cand, seq = candidate_batch(bs, H, G, D, [300] * bs, [[cap_c, cap_c - 3]] * bs, cap_c, gen, integer=True)
    want = lists(run_both(q, k, cand, seq, sink, recent, keep, cap, dense_limit=cap)[1], bs, H, cap)
    for got in run_both(q, k.to(kv_dtype), cand, seq, sink, recent, keep, cap, dense_limit=cap):
        assert lists(got, bs, H, cap) == want


def test_rerank_ties_go_to_the_earlier_entry():
    """Integer keys and queries, every third key a copy of its neighbour: many candidates tie exactly, across the
    threshold too. The kernel's radix search and the twin's stable sort keep the same entries."""
    sink, recent, keep = 2, 4, 7
    cap, cap_c = sink + recent + keep, sink + recent + 4 * keep
    gen = torch.Generator().manual_seed(5)
    bs, H, G, D = 4, 2, 3, 16
    n_lists = [[cap_c] * H] * bs
    q, k, cand, seq = candidate_batch(bs, H, G, D, [200] * bs, n_lists, cap_c, gen, integer=True)
    windows = cand[1]
    for i in range(bs * H):   # candidates pointing at tied keys side by side
        windows[i * cap_c + sink:(i + 1) * cap_c - recent:2] = windows[i * cap_c + sink + 1:(i + 1) * cap_c - recent:2] // 3 * 3
    got, ref = run_both(q, k, cand, seq, sink, recent, keep, cap, dense_limit=cap)
    assert lists(got, bs, H, cap) == lists(ref, bs, H, cap)
    ties = 0
    for i in range(bs * H):
        b, h = divmod(i, H)
        lst = cand[1][i * cap_c:(i + 1) * cap_c].long()
        score = q[b, h * G:(h + 1) * G] @ k[lst, h].T
        ties += len(set(score.sum(0)[sink:cap_c - recent].tolist())) < cap_c - sink - recent
    assert ties == bs * H


def test_rerank_writes_only_its_heads_lists():
    """Hybrid heads: the rerank writes the lists of the layer's retrieval heads; a sparse head's list stays as the
    layer before left it."""
    sink, recent, keep = 4, 8, 10
    cap, cap_c = sink + recent + keep, sink + recent + 2 * keep
    gen = torch.Generator().manual_seed(1)
    bs, H, G, D = 2, 4, 2, 32
    q, k, cand, seq = candidate_batch(bs, H, G, D, [400, 400], [[cap_c] * H] * bs, cap_c, gen)
    got, ref = run_both(q, k, cand, seq, sink, recent, keep, cap, dense_limit=cap, heads=[1, 3])
    assert lists(got, bs, H, cap) == lists(ref, bs, H, cap)
    for b in range(bs):
        for h in range(H):
            assert (int(got[0][b * H + h]) == -1) == (h in (0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("G,D,factor", [(4, 128, 2), (7, 64, 2), (4, 128, 4)])
def test_rerank_real_shapes(G, D, factor):
    """Llama-3.1-8B and Qwen2.5-0.5B group shapes, budget 1024 (sink 16, recent 64), 24 requests with full and
    partial candidate lists over a bf16 KV buffer: the kernel keeps the twin's lists, bar near-ties of bf16 logits
    (at most 2 entries of a list differ)."""
    sink, recent = 16, 64
    keep = 1024 - sink - recent
    cap, cap_c = 1024, 1024 + (factor - 1) * keep
    gen = torch.Generator().manual_seed(factor)
    bs, H = 24, 8 if G == 4 else 2
    n_lists = [[cap_c - (b * 37 + h * 11) % 700 for h in range(H)] for b in range(bs)]
    S = [600 if b == 0 else 32768 for b in range(bs)]
    n_lists[0] = [600] * H
    q, k, cand, seq = candidate_batch(bs, H, G, D, S, n_lists, cap_c, gen, dtype=torch.bfloat16)
    got, ref = run_both(q, k, cand, seq, sink, recent, keep, cap, dense_limit=1024)
    for a, b in zip(lists(got, bs, H, cap), lists(ref, bs, H, cap)):
        assert len(a) == len(b) and len(set(a) ^ set(b)) <= 4
