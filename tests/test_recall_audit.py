"""The live recall audit's parts against brute force: the kept mass of one row, the layer groups, the histogram and
the turns rows take (the lifecycle's audited values: tests/test_pooled_decode.py; through the server:
tests/test_e2e_server.py)."""

import pytest
import torch

from helpers import kept_mass_spec
from sgl_sparsekv import recall_audit
from sgl_sparsekv.recall_audit import AuditedRow, GroupHistogram, RecallAudit, kept_mass, layer_groups


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("tail_from", [40, 33])
def test_kept_mass_is_the_dense_softmax_over_the_attended_tokens(kv_dtype, tail_from, monkeypatch):
    """Lists of different lengths per KV head whose entries past their length hold slots of other tokens (they must
    not count), a tail of positions attended beside them, and keys in blocks smaller than the sequence."""
    monkeypatch.setattr(recall_audit, "KEY_BLOCK", 16)
    g = torch.Generator().manual_seed(0)
    H, G, d, S, slots_total, cap = 2, 3, 8, 40, 64, 12
    k_buf = (torch.randn(slots_total, H, d, generator=g) * 2).to(kv_dtype)
    q = torch.randn(H * G, d, generator=g)
    seq_slots = torch.randperm(slots_total, generator=g)[:S].int()
    lists = seq_slots[torch.randint(0, S, (H, cap), generator=g)]
    lens = torch.tensor([5, 9])
    for h in range(H):   # distinct positions within a list's length
        lists[h, :lens[h]] = seq_slots[torch.randperm(tail_from, generator=g)[:lens[h]]]
    valid = torch.arange(cap)[None, :] < lens[:, None]
    got = kept_mass(q, k_buf, seq_slots, lists, valid, tail_from, 0.3)
    mask = torch.zeros(H, S, dtype=torch.bool)
    mask[:, tail_from:] = True
    for h in range(H):
        pos = {int(s): i for i, s in enumerate(seq_slots)}
        mask[h, [pos[int(s)] for s in lists[h, :lens[h]]]] = True
    k32 = k_buf.float()
    for qh in range(H * G):
        one = kept_mass_spec(q[qh:qh + 1], k32[:, qh // G:qh // G + 1], seq_slots, mask[qh // G:qh // G + 1], 0.3)
        assert abs(float(got[qh]) - one) < 1e-5, (qh, float(got[qh]), one)
    assert abs(float(got.mean()) - kept_mass_spec(q, k32, seq_slots, mask, 0.3)) < 1e-5


def test_layer_groups_cover_every_sparse_layer_once():
    groups = layer_groups(28, first_layer=2)
    assert [label for _, label in groups] == ["2-8", "9-15", "16-22", "23-29"]
    assert [i for layers, _ in groups for i in layers] == list(range(28))
    assert layer_groups(3, first_layer=1) == [(range(0, 1), "1-1"), (range(1, 2), "2-2"), (range(2, 3), "3-3")]


def test_histogram_buckets_hold_each_value_under_its_upper_bound():
    h = GroupHistogram()
    h.add([0.1, 0.5, 0.51, 0.9, 0.999, 1.0, 1.0000001])
    s = h.summary()
    assert s["samples"] == 7 and s["min"] == 0.1 and abs(s["mean"] - sum([0.1, 0.5, 0.51, 0.9, 0.999, 1.0,
                                                                          1.0000001]) / 7) < 1e-12
    assert s["buckets"] == {"0.5": 2, "0.7": 1, "0.8": 0, "0.9": 1, "0.95": 0, "0.98": 0, "0.99": 0, "1.0": 3}
    assert GroupHistogram().summary() == {"samples": 0, "mean": None, "min": None,
                                          "buckets": {str(b): 0 for b in recall_audit.BUCKETS}}


def test_due_steps_take_rows_in_turn_and_a_graph_step_passes_the_turn_on(monkeypatch):
    monkeypatch.setattr(recall_audit, "AUDIT_ROWS", 2)
    audit = RecallAudit(every=2, sparse_layers=3, first_layer=2)
    rows = [AuditedRow(i, 10 + i, 100, i, 100) for i in range(3)]
    assert not audit.due_next() and audit.pick(rows, eager=True, device="cpu") == []
    assert audit.due_next()
    assert audit.pick(rows, eager=False, device="cpu") == []   # due inside a graph: the next eager step measures
    assert audit.pick(rows, eager=True, device="cpu") == rows[:2]
    assert audit.pick(rows, eager=True, device="cpu") == []
    assert audit.pick(rows, eager=True, device="cpu") == [rows[2], rows[0]]
    audit.pick([], eager=True, device="cpu")
    assert audit.pick([], eager=True, device="cpu") == [] and not audit.due_next()   # a due step without rows


def test_values_reach_the_histograms_and_the_exporter_once():
    audit = RecallAudit(every=1, sparse_layers=4, first_layer=2)
    rows = audit.pick([AuditedRow(0, 0, 50, 0, 50)], eager=True, device="cpu")
    audit.values = torch.tensor([[0.5, 0.75, 0.875, 1.0]])   # as record() leaves them after the last layer
    audit.rows = rows
    audit.pending.append(recall_audit.LateRead(audit.values))
    audit.snapshot()   # harvested before any exporter asked: in the histograms only
    audit.pending.append(recall_audit.LateRead(audit.values))
    assert audit.drain() == [("2-2", 0.5), ("3-3", 0.75), ("4-4", 0.875), ("5-5", 1.0)]
    assert audit.drain() == []
    assert {k: v["samples"] for k, v in audit.snapshot().items()} == {"2-2": 2, "3-3": 2, "4-4": 2, "5-5": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,tier", [(torch.bfloat16, False), (torch.float8_e4m3fn, False),
                                           (torch.bfloat16, True)])
def test_audit_at_real_shapes_on_the_gpu_never_waits_for_it(kv_dtype, tier):
    """Llama-3.1-8B's shape (8 KV heads of 4 query heads, d 128) at 32K tokens and budget 1024 in a pool of 40K
    slots: the values recorded for two rows over three layers are the float64 spec's, and neither recording nor
    the copy to the host nor folding a finished copy makes the host wait for the GPU. ``tier``: the lists name rows
    of another buffer holding copies of their keys, as the host tier's hot buffers do."""
    from helpers import sync_check

    g = torch.Generator(device="cuda").manual_seed(0)
    H, G, d, S, cap, layers = 8, 4, 128, 32768, 1024, 3
    slots = 40000
    k_bufs = [torch.randn(slots, H, d, device="cuda", generator=g).to(kv_dtype) for _ in range(layers)]
    q = torch.randn(2, H * G, d, device="cuda", generator=g, dtype=torch.bfloat16)
    req_to_token = torch.stack([torch.randperm(slots, device="cuda", generator=g)[:S] for _ in range(2)]).int()
    lens = torch.tensor([cap - 7 * h for h in range(H)] * 2, device="cuda", dtype=torch.int32)
    windows = torch.empty(2 * H * cap, dtype=torch.int32, device="cuda")
    for j in range(2 * H):   # each list: distinct positions before the tail, as slots of the request reading it
        pos = torch.randperm(S - 64, device="cuda", generator=g)[:cap]
        windows[j * cap:(j + 1) * cap] = req_to_token[1 - j // H, pos]
    audit = RecallAudit(every=1, sparse_layers=layers, first_layer=2)
    rows = [AuditedRow(1, 1, S, 0, S - 64), AuditedRow(0, 0, S, 1, S - 64)]   # batch row 1 reads list row 0
    assert audit.pick(rows, eager=True, device="cuda") == rows
    audit.drain()
    torch.cuda.synchronize()
    lists_at, k_lists = windows, [None] * layers
    if tier:   # list entry i at row i of a buffer of the same keys, in reverse order of the lists
        n = windows.numel()
        lists_at = torch.arange(n - 1, -1, -1, dtype=torch.int32, device="cuda")
        k_lists = [torch.empty_like(k[:n]).index_copy_(0, lists_at.long(), k[windows.long()]) for k in k_bufs]
    with sync_check():
        for layer in range(layers):
            audit.record(layer, q, k_bufs[layer], lens, lists_at, H, cap, req_to_token, d ** -0.5, k_lists[layer])
        copy = audit.pending[-1]
    copy.event.synchronize()
    with sync_check():
        values = audit.drain()
    assert len(values) == 2 * layers
    got = copy.get()
    for r, a in enumerate(rows):
        for layer in range(layers):
            mask = torch.zeros(H, S, dtype=torch.bool)
            mask[:, S - 64:] = True
            where = {int(s): i for i, s in enumerate(req_to_token[a.row].tolist())}
            for h in range(H):
                j = a.list_row * H + h
                picked = windows[j * cap:j * cap + int(lens[j])].tolist()
                mask[h, [where[s] for s in picked]] = True
            want = kept_mass_spec(q[a.i].cpu(), k_bufs[layer].float().cpu(), req_to_token[a.row].cpu(), mask,
                                  d ** -0.5)
            assert abs(float(got[r, layer]) - want) < 2e-4, (r, layer, float(got[r, layer]), want)
