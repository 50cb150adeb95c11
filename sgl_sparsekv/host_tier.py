"""The host KV tier's pool (issue #93; the plan: docs/HOST_TIER.md).

With ``host_tier`` on, SGLang runs the model as a hybrid sliding-window one (``patches/host_tier.py``): the dense
layers keep every token's KV in its full pool, the sparse layers keep only a window per request in its SWA pool,
and SGLang frees the SWA slots of tokens that fall out of that window. ``HostKV`` keeps the sparse layers' KV of
every token, one row per full KV slot: a row lives, is shared by requests over one cached prefix, and is freed
exactly as SGLang's full slot is, so the tier needs no allocator or lifetime of its own. Every write to a sparse
layer's SWA slot is copied to its row here (write-through), in the pool's stored dtype (fp8 KV stays fp8).

The sparse layers' prefill, chunk keys and grafts read their KV here by full slot; their decode reads its own
buffers, per decoding request the chunks it selected (loaded from here where missing) and a ring of its last tokens
(``sgl_sparsekv/tier_rows.py``). On the CPU engine host and device memory are one. On a GPU the rows are pinned
(registered with CUDA) and every reader and writer gets a CUDA tensor over them (:func:`mapped`): its kernels load
and store host memory over the bus through unified addressing, so the readers of a sparse layer's KV (the wrapped
backend's prefill, chunk keys, grafts, the hot buffers' loads) run unchanged, without a copy engine or host thread.
"""

from __future__ import annotations

import weakref

import torch

from sgl_sparsekv.errors import ConfigError

# requests the tier decodes at once: each holds its own hot buffers (sgl_sparsekv/tier_rows.py), allocated at startup
# in the rows of the backend's decoder, which has 64 outside CUDA graphs (patches/backend.py)
MAX_RUNNING = 64


def layer_pattern(dense_layers: int, num_layers: int) -> list[int]:
    """SGLang's ``hybrid_layer_pattern`` for the tier: 0 (full) for the dense layers, 1 (windowed) for the sparse."""
    return [0] * dense_layers + [1] * (num_layers - dense_layers)


def host_budget(host_memory_gb: float, available: int) -> int:
    """Bytes the host pool may take: ``host_memory_gb`` (config), else 90% of the ``available`` host memory."""
    return int(host_memory_gb * 2**30) if host_memory_gb else int(0.9 * available)


class _Mapped:
    """``__cuda_array_interface__`` of registered host bytes: ``torch.as_tensor`` then makes a CUDA tensor over them."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.nbytes,), "typestr": "|u1", "data": (t.data_ptr(), False),
                                         "version": 3, "strides": None}


def mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Register host tensor ``t`` (contiguous) with CUDA and return a CUDA tensor of the same shape and dtype over its
    memory: with unified addressing a registered host page's address is valid on the device, so kernels read and write
    ``t`` in place over the bus. ``t`` must outlive the view. Raises ConfigError (one line) if CUDA refuses, or if a
    value written through the view does not reach ``t`` (a system without unified addressing)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 3)   # cudaHostRegisterPortable | cudaHostRegisterMapped
    if int(rc) != 0:
        raise ConfigError(f"host_tier: CUDA could not pin {t.nbytes / 2**30:.2f} GiB of host memory "
                          f"({cudart.cudaGetErrorString(rc)}); lower --max-total-tokens")
    view = torch.as_tensor(_Mapped(t), device=device).view(t.dtype).view(t.shape)
    probe = view.view(torch.uint8).view(-1)[:1]
    probe.fill_(0x5A)
    torch.cuda.synchronize(device)
    if int(t.view(torch.uint8).view(-1)[0]) != 0x5A:
        raise ConfigError("host_tier: this GPU does not reach pinned host memory through unified addressing")
    probe.zero_()
    torch.cuda.synchronize(device)
    return view


def _unpin(*tensors: torch.Tensor) -> None:
    """Unregister before the memory goes: the kernel otherwise unpins large registrations at process exit, slowly."""
    for t in tensors:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostKV:
    def __init__(self, layer_ids: list[int], rows: int, heads: int, head_dim: int, store_dtype: torch.dtype,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        """``layer_ids``: the sparse layers (global ids); ``rows``: the full KV pool's slots, padding included;
        ``store_dtype``/``dtype``: how the device pool stores the KV and what its readers see (they differ for fp8,
        stored as bytes); ``device``: where its readers run (on a GPU, through :func:`mapped` views)."""
        self.layer_of = {lid: i for i, lid in enumerate(layer_ids)}
        self.dtype = dtype
        shape = (len(layer_ids), rows, heads, head_dim)
        self.k = torch.zeros(shape, dtype=store_dtype)
        self.v = torch.zeros(shape, dtype=store_dtype)
        device = torch.device(device)
        # what readers and writers index: the host tensors themselves, or CUDA tensors over them
        self.k_at, self.v_at = (self.k, self.v) if device.type == "cpu" else (mapped(self.k, device),
                                                                              mapped(self.v, device))
        if device.type == "cuda":
            weakref.finalize(self, _unpin, self.k, self.v)

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
        loc = loc.to(self.k_at.device, torch.int64)
        self.k_at[i].index_copy_(0, loc, k_rows.to(self.k_at.device))
        self.v_at[i].index_copy_(0, loc, v_rows.to(self.v_at.device))

    def key_buffer(self, layer_id: int) -> torch.Tensor:
        """A sparse layer's keys by full KV slot, as the device pool's readers see them."""
        return self._view(self.k_at[self.layer_of[layer_id]])

    def value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_at[self.layer_of[layer_id]])

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.dtype else t.view(self.dtype)
