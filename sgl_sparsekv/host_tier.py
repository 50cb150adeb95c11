"""The host KV tier's pool (issue #93; the plan: docs/HOST_TIER.md).

With ``host_tier`` on, SGLang runs the model as a hybrid sliding-window one (``patches/host_tier.py``): the dense
layers keep every token's KV in its full pool, the sparse layers keep only a window per request in its SWA pool,
and SGLang frees the SWA slots of tokens that fall out of that window. ``HostKV`` keeps the sparse layers' KV of
every token, one row per full KV slot: a row lives, is shared by requests over one cached prefix, and is freed
exactly as SGLang's full slot is, so the tier needs no allocator or lifetime of its own. Every write to a sparse
layer's SWA slot is copied to its row here (write-through), in the pool's stored dtype (fp8 KV stays fp8).

The sparse layers' prefill, chunk keys and grafts read their KV here by full slot; their decode reads its own
buffers, per decoding request the chunks it selected (loaded from here where missing) and a ring of its last tokens
(``sgl_sparsekv/tier_rows.py``). On the CPU engine host and device memory are one; on a GPU the rows will be pinned,
and the loads read them through unified addressing (not built yet).
"""

from __future__ import annotations

import torch

# requests the tier decodes at once: each holds its own hot buffers (sgl_sparsekv/tier_rows.py), allocated at startup
# in the rows of the backend's decoder, which has 64 outside CUDA graphs (patches/backend.py)
MAX_RUNNING = 64


def layer_pattern(dense_layers: int, num_layers: int) -> list[int]:
    """SGLang's ``hybrid_layer_pattern`` for the tier: 0 (full) for the dense layers, 1 (windowed) for the sparse."""
    return [0] * dense_layers + [1] * (num_layers - dense_layers)


class HostKV:
    def __init__(self, layer_ids: list[int], rows: int, heads: int, head_dim: int, store_dtype: torch.dtype,
                 dtype: torch.dtype):
        """``layer_ids``: the sparse layers (global ids); ``rows``: the full KV pool's slots, padding included;
        ``store_dtype``/``dtype``: how the device pool stores the KV and what its readers see (they differ for fp8,
        stored as bytes)."""
        self.layer_of = {lid: i for i, lid in enumerate(layer_ids)}
        self.dtype = dtype
        shape = (len(layer_ids), rows, heads, head_dim)
        self.k = torch.zeros(shape, dtype=store_dtype)
        self.v = torch.zeros(shape, dtype=store_dtype)

    @staticmethod
    def bytes_for(layers: int, rows: int, heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * layers * rows * heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def holds(self, layer_id: int) -> bool:
        return layer_id in self.layer_of

    def write(self, layer_id: int, loc: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Rows ``loc`` (full KV slots) of a sparse layer take ``k_rows``/``v_rows`` [n, heads, head_dim], in the
        stored dtype."""
        i = self.layer_of[layer_id]
        loc = loc.to(self.k.device, torch.int64)
        self.k[i].index_copy_(0, loc, k_rows.to(self.k.device))
        self.v[i].index_copy_(0, loc, v_rows.to(self.v.device))

    def key_buffer(self, layer_id: int) -> torch.Tensor:
        """A sparse layer's keys by full KV slot, as the device pool's readers see them."""
        return self._view(self.k[self.layer_of[layer_id]])

    def value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v[self.layer_of[layer_id]])

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.dtype else t.view(self.dtype)
