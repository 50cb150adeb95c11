"""Which of the model's KV heads one tensor-parallel rank holds.

SGLang shards attention by heads (``QKVParallelLinear``): with ``tp_size`` ranks over ``total`` KV heads, rank
``r`` holds heads ``[r * total // tp_size, (r + 1) * total // tp_size)``; with more ranks than KV heads each rank
holds one head, replicated on ``tp_size // total`` consecutive ranks. Everything a rank keeps (index pools,
unit store, index cache) covers only its heads; what depends on token ids alone (chunk cuts) comes out the same
on every rank. Head roles are given for the whole model and each rank takes its heads' roles
(``head_roles.resolve(..., heads=shard.heads)``), so a head retrieves or reuses exactly as it would on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_sparsekv.errors import ConfigError


@dataclass(frozen=True)
class KVShard:
    start: int   # the model's index of this rank's first KV head
    count: int   # KV heads on this rank
    total: int   # KV heads of the model

    @classmethod
    def whole(cls, heads: int) -> "KVShard":
        return cls(0, heads, heads)

    @classmethod
    def of_rank(cls, total: int, tp_size: int, tp_rank: int) -> "KVShard":
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
        if tp_size >= total:
            if tp_size % total:
                raise ConfigError(f"sparse-kv: --tp-size {tp_size} does not replicate the model's {total} KV heads "
                                  "evenly")
            return cls(tp_rank // (tp_size // total), 1, total)
        if total % tp_size:
            raise ConfigError(f"sparse-kv: the model's {total} KV heads do not split evenly over --tp-size {tp_size}")
        count = total // tp_size
        return cls(tp_rank * count, count, total)

    @property
    def heads(self) -> range:
        return range(self.start, self.start + self.count)
