"""IndexCache: cluster indexes of finished or running prefixes, so requests that share a prefix share
its index instead of clustering it again (forks over one document, the next turn of a chat).

An entry is a unit chain from position 0 (unit ids) and the index of every sparse layer over exactly
those units (one ``PackedIndex`` whose heads are layer-major, as the index pools load it: int8 centroid codes,
so the cache holds about 1.8x the prefixes it held with bf16 centroids at head_dim 128). It holds one
reference on each of its units, so no id it names can be recycled while it lives. A request adopts the
entry sharing the longest chain prefix with its own chain, if that prefix covers enough of it: the entry's
index without the units past the shared prefix becomes a shared segment of the index pools
(``IndexPools.acquire``; one copy for every request that adopts the same prefix), and the request clusters its
own remaining units into a segment of its own.
Least recently used entries beyond ``max_entries`` go, releasing their units.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from sgl_sparsekv.index import ClusterIndex, PackedIndex, recount

# memory for cached indexes, at most; SGLang's memory plan sets it aside before sizing the KV pool
# (patches/plugin.py: reserve_index_cache)
CACHE_BYTES = 1 << 30


@dataclass
class CachedIndex:
    units: np.ndarray                       # int64 unit ids
    lengths: torch.Tensor                   # tokens per unit
    index: PackedIndex


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two unit chains (int64 arrays of ids)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def longest_shared(chains, units: np.ndarray, min_shared: float) -> tuple[object, int] | None:
    """(key, shared prefix length) of the (key, chain) pair sharing the longest prefix with ``units`` (the first
    such), if that prefix covers at least ``min_shared`` of ``units``; else None."""
    best = None
    for key, c in chains:
        n = common_prefix(c, units)
        if n and (best is None or n > best[1]):
            best = (key, n)
    return None if best is None or best[1] < min_shared * len(units) else best


def chain(units) -> np.ndarray:
    """A unit chain as the cache compares it (a request's thousands of ids converted once, not per entry)."""
    return np.asarray(units, dtype=np.int64)


def truncate(index: ClusterIndex, lengths: torch.Tensor, n: int) -> ClusterIndex:
    """The index restricted to its first ``n`` chunks. Centroids and radii stay: the radii still cover
    every remaining member, so the bounds stay valid (only a little looser)."""
    if index.num_chunks == n:
        return index
    index.chunk_fine = index.chunk_fine[:, :n].contiguous()
    return recount(index, lengths[:n])


class IndexCache:
    def __init__(self, store, max_entries: int = 16, max_bytes: int = CACHE_BYTES, min_shared: float = 0.75):
        self.store = store
        self.entries: OrderedDict[int, CachedIndex] = OrderedDict()
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.min_shared = min_shared
        self._by_chain: dict[tuple[int, int], int] = {}
        self._next = 0

    def find(self, units: list[int]) -> tuple[int, int] | None:
        """(entry id, shared prefix length) of the best entry for a chain, or None."""
        best = longest_shared(((eid, e.units) for eid, e in self.entries.items()), chain(units), self.min_shared)
        if best is not None:
            self.entries.move_to_end(best[0])
        return best

    def adopt(self, eid: int, shared: int) -> PackedIndex:
        """The entry's index over its first ``shared`` units (new tensors where they differ; the entry's stay)."""
        entry = self.entries[eid]
        packed = entry.index
        return replace(packed, index=truncate(ClusterIndex(**vars(packed.index)), entry.lengths, shared))

    def add(self, units: list[int], lengths: torch.Tensor, packed: PackedIndex) -> None:
        """Cache the packed index over exactly ``units`` (replacing the entry of the same chain); the entry keeps
        its tensors, so the caller hands over ones nothing else writes (``ClusterIndex.pack`` makes such)."""
        units = chain(units)
        if not len(units) or packed.num_chunks != len(units):
            return
        key = (int(units[-1]), len(units))
        self.store.retain(units)   # before dropping an entry of the same chain, so no unit goes in between
        if key in self._by_chain:
            self._evict(self._by_chain[key])
        eid = self._next
        self._next += 1
        self.entries[eid] = CachedIndex(units, lengths.clone(), packed)
        self._by_chain[key] = eid
        self.bytes += self.entries[eid].index.nbytes()
        while len(self.entries) > 1 and (len(self.entries) > self.max_entries or self.bytes > self.max_bytes):
            self._evict(next(iter(self.entries)))

    def put(self, units: list[int], lengths: torch.Tensor, packed: PackedIndex) -> None:
        """Cache the index of a finished request; drops the entries its chain extends."""
        units = chain(units)
        for eid in [e for e, ent in self.entries.items()
                    if len(ent.units) < len(units) and common_prefix(ent.units, units) == len(ent.units)]:
            self._evict(eid)
        self.add(units, lengths, packed)

    def _evict(self, eid: int) -> None:
        entry = self.entries.pop(eid)
        self.bytes -= entry.index.nbytes()
        del self._by_chain[(int(entry.units[-1]), len(entry.units))]
        self.store.release(entry.units)

    def clear(self) -> None:
        for eid in list(self.entries):
            self._evict(eid)

    def nbytes(self) -> int:
        return self.bytes
