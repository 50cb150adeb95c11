"""The host KV tier's pool (issue #93; the plan: docs/HOST_TIER.md).

With ``host_tier`` on, SGLang runs the model as a hybrid sliding-window one (``patches/host_tier.py``): the dense
layers keep every token's KV in its full pool, the sparse layers keep only a window per request in its SWA pool,
and SGLang frees the SWA slots of tokens that fall out of that window. ``HostKV`` keeps the sparse layers' KV of
every token, one row per full KV slot: a row lives, is shared by requests over one cached prefix, and is freed
exactly as SGLang's full slot is, so the tier needs no allocator or lifetime of its own. Every write to a sparse
layer's SWA slot is copied to its row here (write-through), in the pool's stored dtype (fp8 KV stays fp8).

The sparse layers' chunk keys and grafts read their KV here by full slot; their prefill reads a device copy of
one layer at a time, *staged* before the layer's attention: every row the batch's prefixes name is copied over at
once, so the attention, which reads a prefix once per tile of queries, reads device memory rather than the bus.
Their decode reads its own buffers, per decoding request the chunks it selected (loaded from here where missing) and
a ring of its last tokens (``sgl_sparsekv/tier_rows.py``). On the CPU engine host and device memory are one. On a
GPU the rows are pinned (registered with CUDA) and every reader and writer gets a CUDA tensor over them
(:func:`mapped`): its kernels load and store host memory over the bus through unified addressing, so the readers of
a sparse layer's KV (the wrapped backend's prefill, chunk keys, grafts, the hot buffers' loads) run unchanged,
without a copy engine or host thread.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from sgl_sparsekv.errors import ConfigError
from sgl_sparsekv.kernels.host_copy import stage_rows, stage_rows_ref
from sgl_sparsekv.transfer import to_device

# requests the tier decodes at once: each holds its own hot buffers (sgl_sparsekv/tier_rows.py), allocated at startup
# in the rows of the backend's decoder, which has 64 outside CUDA graphs (patches/backend.py)
MAX_RUNNING = 64


def layer_pattern(dense_layers: int, num_layers: int) -> list[int]:
    """SGLang's ``hybrid_layer_pattern`` for the tier: 0 (full) for the dense layers, 1 (windowed) for the sparse."""
    return [0] * dense_layers + [1] * (num_layers - dense_layers)


# Host memory a GPU server keeps beside the host pool. On one H100 host (Llama-3.1-8B shape, 8 decode graphs, 125 GB)
# the server's processes used 27 GiB more than an 80 GiB pool at their peak, and a 96 GiB pool, with 114 GiB free at
# startup, was killed by the kernel mid-serving (bench/results/gpu_serving_h100_capacity32.json). SGLang's HiCache
# keeps 10 GiB aside for the same reason. On the CPU engine SGLang's own plan already counts the host as its device.
HOST_RESERVE_BYTES = 32 * 2**30


def host_budget(host_memory_gb: float, available: int, reserve: int) -> int:
    """Bytes the host pool may take: ``host_memory_gb`` (config), else 90% of the ``available`` host memory beyond
    ``reserve`` (what the rest of the server needs). Raises ConfigError (one line) for a size over that."""
    room = max(0, available - reserve)
    if host_memory_gb * 2**30 > room:
        raise ConfigError(f"host_tier: host_memory_gb ({host_memory_gb:g}) is more than the {room / 2**30:.2f} GiB "
                          f"of host memory available beyond the {reserve / 2**30:g} GiB the rest of the server needs")
    return int(host_memory_gb * 2**30) if host_memory_gb else int(0.9 * room)


# The tier's prefill chunk where --chunked-prefill-size is not given (patches/flags.py): a running request keeps its
# last chunk in the window pool (window_slots), so SGLang's 8,192 on an H100 would take 9.3K window slots a request,
# 36 GB for 32 requests of the Llama-3.1-8B shape beside their 19 GB of hot buffers; at 2,048, 12 GB.
TIER_CHUNK = 2048


def window_slots(requests: int, host_window: int, chunk: int, slack: int) -> int:
    """Window slots for ``requests`` running requests at worst, what the window pool gets unless
    ``--swa-full-tokens-ratio`` says otherwise. Besides its last ``host_window`` tokens a request keeps there the
    last chunk of its prefill (up to ``chunk``: ``--chunked-prefill-size``) until it ends, since the radix tree locks
    a request's window by whole nodes and a prefill inserts one node a chunk (with chunks of 8,192, 11 requests of 32K
    prompts filled 83,885 window slots on an H100), and ``slack`` more (the tokens decoded since SGLang last freed
    those out of its window, and page rounding); two more chunks are being prefilled (the overlap scheduler runs one
    batch ahead). A request that finds too little room waits."""
    return requests * (host_window + chunk + slack) + 2 * chunk


def window_requests(slots: int, host_window: int, chunk: int, slack: int) -> int:
    """The requests a window pool of ``slots`` holds at worst: :func:`window_slots`'s inverse."""
    return max(0, slots - 2 * chunk) // (host_window + chunk + slack)


def host_reserve(device) -> int:
    """``HOST_RESERVE_BYTES`` beside a GPU; nothing on the CPU engine, whose plan sizes its pools from host memory."""
    return 0 if torch.device(device).type == "cpu" else HOST_RESERVE_BYTES


def prefix_slots(req_to_token: torch.Tensor, rows: list[int], prefix_lens: list[int]) -> torch.Tensor:
    """The full KV slots of a prefill batch's prefixes, what its attention reads besides its own tokens: the first
    ``prefix_lens[i]`` positions of request row ``rows[i]``, int64 on ``req_to_token``'s device (no wait for it)."""
    n = sum(prefix_lens)
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=req_to_token.device)
    base = np.repeat(np.asarray(rows, dtype=np.int64) * req_to_token.shape[1], prefix_lens)
    pos = np.arange(n) - np.repeat(np.cumsum(prefix_lens) - prefix_lens, prefix_lens)
    flat = to_device(torch.from_numpy(base + pos), req_to_token.device)
    return req_to_token.view(-1).index_select(0, flat).to(torch.int64)


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
        # the prefill's device copy of one layer, by full slot (:meth:`stage`); on the CPU engine a copy too, so that
        # both engines run one path
        self.stage_k, self.stage_v = (torch.zeros(shape[1:], dtype=store_dtype, device=device) for _ in range(2))
        self.staged = None   # the layer whose rows the stage holds while its prefill attention runs
        self.mark = torch.full((rows,), -1, dtype=torch.int32, device=device)   # a row's last stage (stage_rows)
        self.gen = -1
        self._stage_rows = stage_rows if device.type == "cuda" else stage_rows_ref
        # rows the stages copied from the window pool and over the bus, counted at the first sparse layer (every
        # sparse layer copies the same rows), on the reader device so that no prefill waits for the count
        self.staged_near_far = torch.zeros(2, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_for(layers: int, rows: int, heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * layers * rows * heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one (layer, KV head, token) row, key and value: what the hot buffers load per row they miss."""
        return 2 * self.k.shape[-1] * self.k.element_size()

    @property
    def stage_nbytes(self) -> int:
        """Reader-device bytes of the prefill's stage: one sparse layer's KV per full slot."""
        return self.stage_k.nbytes + self.stage_v.nbytes

    def holds(self, layer_id: int) -> bool:
        return layer_id in self.layer_of

    def write(self, layer_id: int, loc: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Rows ``loc`` (full KV slots) of a sparse layer take ``k_rows``/``v_rows`` [n, heads, head_dim], in the
        stored dtype."""
        i = self.layer_of[layer_id]
        loc = loc.to(self.k_at.device, torch.int64)
        k_rows, v_rows = k_rows.to(self.k_at.device), v_rows.to(self.v_at.device)
        self.k_at[i].index_copy_(0, loc, k_rows)
        self.v_at[i].index_copy_(0, loc, v_rows)
        if self.staged == layer_id:   # the prefill's own tokens, which its attention may read back from the pool
            self.stage_k.index_copy_(0, loc, k_rows)
            self.stage_v.index_copy_(0, loc, v_rows)

    def stage(self, layer_id: int, slots: torch.Tensor, near: tuple | None = None) -> None:
        """Copy rows ``slots`` (full KV slots, int64 on the reader device, repeats allowed) of a sparse layer to the
        stage, which its readers see until :meth:`unstage`; rows written meanwhile land there too. ``near``:
        (k_rows, v_rows, near_of), the layer's rows still on the device (SGLang's window pool, in the stored
        dtype) and each full slot's row there (0: none), which are copied from there instead of over the bus.
        Stream-ordered: the next layer's stage waits for this layer's attention like any kernel after it."""
        if self.gen == 2**31 - 2:
            self.mark.fill_(-1)
            self.gen = -1
        self.gen += 1
        i = self.layer_of[layer_id]
        self._stage_rows(self.k_at[i], self.v_at[i], self.stage_k, self.stage_v, slots, self.mark, self.gen, near)
        self.staged = layer_id
        if i == 0 and slots.numel():
            copied = self.mark == self.gen   # each row once, however many of the batch's requests name it
            close = copied & (near[2][:copied.shape[0]] != 0) if near is not None else torch.zeros_like(copied)
            self.staged_near_far += torch.stack([close.sum(), copied.sum() - close.sum()])

    def unstage(self) -> None:
        self.staged = None

    def key_buffer(self, layer_id: int) -> torch.Tensor:
        """A sparse layer's keys by full KV slot, as the device pool's readers see them (the stage while it holds
        the layer: only the rows staged and written since are valid there)."""
        return self._view(self.stage_k if self.staged == layer_id else self.k_at[self.layer_of[layer_id]])

    def value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.stage_v if self.staged == layer_id else self.v_at[self.layer_of[layer_id]])

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.dtype else t.view(self.dtype)
