"""Tensor parallelism: each rank keeps state for its own KV heads and decodes exactly what one GPU would for them.

One SGLang radix world (real RadixCache, allocator, request pool) is prefilled and decoded by the whole model's
manager and, beside it, by one manager per TP rank holding only that rank's KV heads (``KVShard``). Every rank
must cut the same chunks, and give each of its heads the token list and attention output that the whole model
gives that head, with all heads retrieving and with a hybrid role map whose roles differ by head.
"""

import random

import pytest
import torch

from sgl_sparsekv import head_roles
from sgl_sparsekv.config import ConfigError
from sgl_sparsekv.manager import SparseKVManager
from sgl_sparsekv.patches.backend import watch_frees
from sgl_sparsekv.pooled_decode import PooledDecode
from sgl_sparsekv.tensor_parallel import KVShard
from tests.test_pooled_decode import G, TwinWorld
from tests.test_radix_state import LAYERS, SLOTS, D, H, synthetic_table


@pytest.mark.parametrize("total,tp,heads", [
    (8, 1, [range(8)]), (8, 2, [range(4), range(4, 8)]), (8, 8, [range(h, h + 1) for h in range(8)]),
    (2, 4, [range(1), range(1), range(1, 2), range(1, 2)]),   # more ranks than KV heads: each head replicated
])
def test_rank_kv_heads_follow_sglang_sharding(total, tp, heads):
    assert [KVShard.of_rank(total, tp, r).heads for r in range(tp)] == heads


@pytest.mark.parametrize("total,tp", [(3, 2), (2, 3), (4, 6)])
def test_uneven_sharding_is_a_config_error(total, tp):
    with pytest.raises(ConfigError, match="--tp-size"):
        KVShard.of_rank(total, tp, 0)


def test_role_map_is_sliced_by_rank(tmp_path):
    path = tmp_path / "roles.json"
    path.write_text('{"layers": ["dense", "RRRR", "SRSR", "SSRR"]}')
    whole = head_roles.resolve(str(path), 4, 4, 1)
    assert whole == [[0, 1, 2, 3], [1, 3], [2, 3]]
    assert head_roles.resolve(str(path), 4, 4, 1, heads=range(0, 2)) == [[0, 1], [1], []]
    assert head_roles.resolve(str(path), 4, 4, 1, heads=range(2, 4)) == [[0, 1], [1], [0, 1]]
    staggered = head_roles.resolve("staggered-0.3", 12, 4, 2)
    for r in range(2):
        part = head_roles.resolve("staggered-0.3", 12, 4, 2, heads=KVShard.of_rank(4, 2, r).heads)
        assert part == [[h - 2 * r for h in row if 2 * r <= h < 2 * r + 2] for row in staggered]


class ShardedWorld(TwinWorld):
    """A TwinWorld whose KV heads are also held, rank by rank, by ``tp`` managers of their own."""

    def __init__(self, seed, tp, overrides=None):
        super().__init__(seed, overrides)
        self.ranks = []
        for r in range(tp):
            shard = KVShard.of_rank(H, tp, r)
            m = SparseKVManager(self.cfg, LAYERS, shard.count, D, SLOTS + 1, boundary_table=synthetic_table(),
                                kv_shard=shard)
            watch_frees(m, self.req_pool, self.alloc)
            heads = slice(shard.start, shard.start + shard.count)
            self.holders.append((m, heads))
            self.ranks.append((shard, heads, m, PooledDecode(m, max_bs=8, q_heads=shard.count * G, parts=2)))
        self.compared = 0

    def decode_compare(self, reqs):
        rows, seqs, toks = self.append_tokens(reqs)
        r2t, scale = self.req_pool.req_to_token, D ** -0.5
        self.decoder.prepare(rows, seqs, len(rows), r2t, toks, lambda l: self.k[l])
        for _, heads, _, dec in self.ranks:
            dec.prepare(rows, seqs, len(rows), r2t, toks, lambda l, h=heads: self.k[l][:, h])
        for l in range(self.cfg.dense_layers, LAYERS):
            sl = l - self.cfg.dense_layers
            q = torch.randn(len(rows), H * G, D, generator=self.qgen)
            whole = self.decoder.attend(q, self.k[l], self.v[l], sl, r2t, scale)
            for shard, heads, _, dec in self.ranks:
                qh = slice(shard.start * G, (shard.start + shard.count) * G)
                out = dec.attend(q[:, qh].contiguous(), self.k[l][:, heads].contiguous(),
                                 self.v[l][:, heads].contiguous(), sl, r2t, scale)
                assert torch.allclose(out, whole[:, qh], atol=1e-5), (l, shard)
                for i in range(len(rows)):
                    for hl in range(shard.count):
                        j, jw = i * shard.count + hl, i * H + shard.start + hl
                        got, want = dec.token_list(j).tolist(), self.decoder.token_list(jw).tolist()
                        assert sorted(got) == sorted(want), (l, rows[i], shard, hl)
                        self.compared += 1


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("roles", ["all-retrieval", '{"layers": ["dense", "RR", "SR", "RS"]}'])
def test_ranks_decode_what_one_gpu_decodes(tmp_path, tp, roles):
    if roles.startswith("{"):
        (tmp_path / "roles.json").write_text(roles)
        roles = str(tmp_path / "roles.json")
    w = ShardedWorld(0, tp, {"head_roles": roles})
    w.rng = random.Random(0)
    for step in range(16):
        if step % 5 == 0 and len(w.live) < 3:
            w.start()   # shares a document prefix with earlier requests: the radix cache reuses it
        else:
            w.decode_compare(list(w.live))
    w.finish(w.live[0], abort=False)
    for _ in range(30):   # past the recent window's edge: grafts
        w.decode_compare(list(w.live))
    whole = w.manager.snapshot_stats()
    assert whole["attended_tokens"] < whole["context_tokens"] and whole["grafts"] > 0 and w.compared > 100
    for shard, _, m, _ in w.ranks:
        st = m.snapshot_stats()
        assert st["kv_heads"] == [shard.start, shard.start + shard.count]
        # chunk cuts depend on token ids only, so every rank cuts, builds, adopts and grafts the same units
        for key in ("units_built", "units_reused", "index_builds", "index_reused", "grafts", "live_units",
                    "attended_tokens", "context_tokens"):
            assert st[key] == whole[key], (key, shard)
        assert st["unit_refs_unaccounted"] == 0
