"""UnitStore: retrieval units (lychee chunks, quest pages), shared through the radix cache.

A unit is a run of token positions ``[start, end)`` of some token sequence. It is recorded once (its key is
computed from the KV when one is needed) and *keyed by the KV slot of the last token of its decision window* (position
``start + lookahead - 1``, see ``Chunker.lookahead``). Requests that share a cached prefix share
those slots, so a new request finds the prefix's units by reading the slots its radix hit gave
it, without recomputing anything.

Why that slot: one KV slot sits at one position of one radix path, so a hit on it proves that
every token the unit's cut depended on is the same (a unit keyed by its own last token could
have been cut differently by a request whose later tokens differed). And SGLang frees KV slots
from the tail of a path (eviction takes leaves; a node split only relabels), so when any slot of
the unit is freed, the key slot (at or after them) is freed too, which drops the key.
Units are reference counted: the key slot holds one reference and every request whose chain
uses the unit holds one, so a request keeps its units even if a duplicate of its KV is freed
under it (the radix cache deduplicates on insert).
"""

from __future__ import annotations

import numpy as np
import torch

from sgl_sparsekv.stats import Counters


class UnitStore:
    def __init__(self, num_slots: int, capacity: int = 1024, stats: Counters | None = None):
        # bookkeeping lives on the host in numpy (read element by element, and a request's thousands of units
        # are retained and released at once: torch's per-element indexing cost tens of ms per 32K request)
        self.slot_unit = np.full(num_slots, -1, dtype=np.int64)
        self.capacity = 0
        self.unit_start = np.empty(0, dtype=np.int64)
        self.unit_end = np.empty(0, dtype=np.int64)
        self.refs = np.empty(0, dtype=np.int32)
        self._free: list[int] = []
        self.unkeyed = 0   # units whose key slot is still on its way back from the device
        self.stats = Counters() if stats is None else stats   # its owner's (``units_*``)
        self._grow(capacity)

    # ------------------------------------------------------------------ storage
    def _grow(self, capacity: int) -> None:
        old = self.capacity
        if capacity <= old:
            return
        pad = capacity - old
        self.unit_start = np.concatenate([self.unit_start, np.zeros(pad, dtype=np.int64)])
        self.unit_end = np.concatenate([self.unit_end, np.zeros(pad, dtype=np.int64)])
        self.refs = np.concatenate([self.refs, np.zeros(pad, dtype=np.int32)])
        self._free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def _alloc(self) -> int:
        if not self._free:
            self._grow(max(1024, 2 * self.capacity))
        return self._free.pop()

    @property
    def live_units(self) -> int:
        return self.capacity - len(self._free)

    @property
    def keyed_units(self) -> int:
        return int((self.slot_unit >= 0).sum())

    def nbytes(self) -> int:
        return self.live_units * (8 + 8 + 4)

    # ------------------------------------------------------------------ units
    def add_unkeyed(self, start: int, end: int) -> int:
        """A new unit ``[start, end)`` whose key slot is not known on the host yet (it comes back from the
        device one step late, see :meth:`key`); one reference for the caller, one held for the slot."""
        uid = self._alloc()
        self.unit_start[uid], self.unit_end[uid] = start, end
        self.refs[uid] = 2
        self.unkeyed += 1
        self.stats.units_built += 1
        return uid

    def key(self, uids: list[int], slots: list[int]) -> None:
        """Key units from :meth:`add_unkeyed` by their key slots (the slot's reference was taken already)."""
        for uid, slot in zip(uids, slots):
            old = int(self.slot_unit[slot])
            if old >= 0:   # a unit of another method or setting: the slot changes hands
                self.release([old])
            self.slot_unit[slot] = uid
        self.unkeyed -= len(uids)

    def drop_unkeyed(self, uids: list[int]) -> None:
        """Units from :meth:`add_unkeyed` that will never be keyed: the slot's reference goes."""
        self.unkeyed -= len(uids)
        self.release(uids)

    def chain(self, slots: torch.Tensor, lookahead: int) -> list[int]:
        """Units reusable by a request whose first ``len(slots)`` tokens sit in ``slots``.

        Walks the unit chain from position 0: the unit starting at ``pos`` is keyed at
        ``slots[pos + lookahead - 1]``. Takes one reference per returned unit.
        """
        found: list[int] = []
        pos, n = 0, len(slots)
        keyed = self.slot_unit[slots.cpu().numpy()] if n else []
        start, end = self.unit_start, self.unit_end
        while pos + lookahead <= n:
            uid = int(keyed[pos + lookahead - 1])
            if uid < 0 or start[uid] != pos:
                break
            found.append(uid)
            pos = int(end[uid])
        self.retain(found)
        self.stats.units_reused += len(found)
        return found

    def retain(self, ids) -> None:
        if len(ids):
            touched, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
            self.refs[touched] += counts.astype(self.refs.dtype)

    def release(self, ids) -> None:
        if not len(ids):
            return
        touched, first, counts = np.unique(np.asarray(ids, dtype=np.int64), return_index=True, return_counts=True)
        self.refs[touched] -= counts.astype(self.refs.dtype)
        assert (self.refs[touched] >= 0).all(), "a unit released more often than retained"
        gone = touched[np.argsort(first)]   # in the order given, as a loop of single releases would free them
        gone = gone[self.refs[gone] == 0]
        self._free.extend(gone.tolist())
        self.stats.units_freed += len(gone)

    def free_slots(self, slots: torch.Tensor) -> None:
        """KV slots went back to the allocator: drop the units keyed by them."""
        slots = slots.to("cpu", torch.int64).numpy()
        ids = self.slot_unit[slots]
        hit = ids >= 0
        if hit.any():
            self.slot_unit[slots[hit]] = -1
            self.release(ids[hit])

    def clear(self) -> None:
        """Every slot was freed (cache flush). Units still used by live requests keep their reference."""
        self.free_slots(torch.from_numpy(np.flatnonzero(self.slot_unit >= 0)))

    def snapshot(self) -> set[tuple[int, int, int]]:
        """(key slot, start, end) of every keyed unit; for tests that compare with a rebuild."""
        return {(slot, int(self.unit_start[uid]), int(self.unit_end[uid]))
                for slot, uid in ((slot, int(self.slot_unit[slot])) for slot in np.flatnonzero(self.slot_unit >= 0))}
