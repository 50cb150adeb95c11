"""IndexPools: the cluster indexes of live requests, every sparse layer, in fixed device tensors.

The decode kernels (``kernels/select.py``) read these pools inside a CUDA graph, so they are
allocated once, at startup, and sized from the KV pool (see :func:`pool_capacity`; the same
numbers are charged to SGLang's memory planning by ``patches/plugin.py``). An index occupies one range
of rows in each pool (a segment, ``PoolRanges``); a request's own segment has chunk rows to spare, so
grafting decoded chunks only writes rows.

    coarse  mu [Ls, C, H, d]  scale/r/tok/n [Ls, C, H]
    fine    mu [Ls, F, H, d]  scale/r/tok/n [Ls, F, H]  parent [Ls, F, H] (local coarse index)
    box     [Ls, F, H, 2, d] (center, half-width in bf16; fine_bound "box", else d = 0)
    (centroids mu as int8 codes times their row's power-of-two scale, ``index.quantize``; the rest fp32 / int32)
    chunk   fine [Ls, K, H] (local fine index)   start/length [K] (token positions)

An index over all sparse layers at once (heads ``Ls * H``, layer-major) moves into a range as a ``PackedIndex``
(:meth:`IndexPools.load`, centroid codes copied as they are) and out of it the same way
(:meth:`IndexPools.export_packed`).

Requests that adopt one cached prefix index share one copy of it: a *shared segment*, loaded once and
refcounted (:meth:`IndexPools.acquire` / :meth:`IndexPools.release`), which nothing writes while it lives. Each
request also owns a segment of its own (the chunks past the prefix, and the chunks grafted at decode); the
kernels read the two as one index (``kernels/select.py``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from sgl_sparsekv.config import SparseKVConfig
from sgl_sparsekv.index import (BOX_DTYPE, CODE_DTYPE, ClusterIndex, PackedIndex, dequantize, quantize, quantize_box,
                                recount)
from sgl_sparsekv.kernels.select import Centroids, ChunkRows, CoarseRows, FineRows, Segment


class RangeAllocator:
    """First-fit allocator of row ranges in ``[0, capacity)``; freed neighbours merge."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts = [0]
        self._sizes = [capacity]

    def alloc(self, n: int) -> int | None:
        if n <= 0:
            raise ValueError(f"range of {n} rows")
        for i, size in enumerate(self._sizes):
            if size >= n:
                start = self._starts[i]
                assert 0 <= start and start + n <= self.capacity, (start, n, self.capacity)
                if size == n:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += n
                    self._sizes[i] -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self._starts, start)
        # a double free or a range past the end would hand the same rows to two requests
        assert 0 <= start and start + n <= self.capacity, (start, n, self.capacity)
        assert i == 0 or self._starts[i - 1] + self._sizes[i - 1] <= start, ("overlaps a free range", start, n)
        assert i == len(self._starts) or start + n <= self._starts[i], ("overlaps a free range", start, n)
        self._starts.insert(i, start)
        self._sizes.insert(i, n)
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)

    def compacted(self, used: int) -> None:
        """After the rows in use moved to the front: ``[0, used)`` allocated, the rest one free range."""
        assert 0 <= used <= self.capacity, (used, self.capacity)
        self._starts, self._sizes = ([used], [self.capacity - used]) if used < self.capacity else ([], [])

    @property
    def free_rows(self) -> int:
        return sum(self._sizes)

    @property
    def used_rows(self) -> int:
        return self.capacity - self.free_rows


@dataclass
class PoolRanges:
    """One segment of an index in the pools: its first row and row count at each level (the chunk level owns
    ``chunk_rows`` rows and has recorded ``chunks`` of them; grafts append)."""

    coarse_at: int
    coarse: int
    fine_at: int
    fine: int
    chunk_at: int
    chunks: int
    chunk_rows: int

    def segment(self) -> Segment:
        """The rows the selection kernels read (``kernels.select.Segment``)."""
        return Segment(self.coarse_at, self.coarse, self.fine_at, self.fine, self.chunk_at, self.chunks)


@dataclass(frozen=True)
class PoolCapacity:
    coarse: int
    fine: int
    chunks: int

    def nbytes(self, layers: int, heads: int, head_dim: int, box: bool = False) -> int:
        node = heads * (head_dim * CODE_DTYPE.itemsize + 4 * 4)   # mu; scale, r, tok, n in fp32
        fine = node + heads * 4 + box * heads * 2 * head_dim * BOX_DTYPE.itemsize   # parent; the box
        per_layer = self.coarse * node + self.fine * fine + self.chunks * heads * 4
        return layers * per_layer + self.chunks * 8


def pool_capacity(cfg: SparseKVConfig, num_slots: int) -> PoolCapacity:
    """Rows that hold indexes over ``index_pool_scale`` x every KV slot at the smallest chunk size (real chunks
    are longer, which leaves the grafting room). Requests over one cached prefix share one copy of its index
    (beside the copy of the request that built it). Proportional to the slots, so it can be charged per KV
    slot."""
    units = int(num_slots * cfg.index_pool_scale) // cfg.chunk_min
    # a chunk row costs about 1/100 of a fine row: twice the rows leave each request its grafting room
    # (a quarter of its chunks) and range moves without the chunk pool filling before the fine pool
    chunks = 2 * units + 64
    fine = math.ceil(units / cfg.fine_cluster_size) + 64
    coarse = fine // 4 + 64     # P <= sqrt(L) <= L / 4 once a request has 16 fine clusters
    return PoolCapacity(coarse, fine, chunks)


# per level: the fields of a PoolRanges that give a segment's first row and the rows it holds
LEVEL_ROWS = {"coarse": ("coarse_at", "coarse"), "fine": ("fine_at", "fine"), "chunks": ("chunk_at", "chunk_rows")}


class IndexPools:
    def __init__(self, cap: PoolCapacity, layers: int, heads: int, head_dim: int, device, box: bool = False):
        def f32(*shape):
            return torch.zeros(*shape, dtype=torch.float32, device=device)

        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        def mu(rows):
            return torch.zeros(layers, rows, heads, head_dim, dtype=CODE_DTYPE, device=device)

        # the fields of ``index.ClusterIndex``, one row per cluster (centroids as codes beside their scales)
        self.coarse_mu, self.coarse_scale, self.coarse_r, self.coarse_tokens, self.coarse_n = (
            mu(cap.coarse), *(f32(layers, cap.coarse, heads) for _ in range(4)))
        self.fine_mu, self.fine_scale, self.fine_r, self.fine_tokens, self.fine_n = (
            mu(cap.fine), *(f32(layers, cap.fine, heads) for _ in range(4)))
        self.fine_parent = torch.zeros(layers, cap.fine, heads, dtype=torch.int32, device=device)
        self.box = box
        self.fine_box = torch.zeros(layers, cap.fine, heads, 2, head_dim if box else 0, dtype=BOX_DTYPE, device=device)
        self.chunk_fine = torch.zeros(layers, cap.chunks, heads, dtype=torch.int32, device=device)
        self.chunk_start = torch.zeros(cap.chunks, dtype=torch.int32, device=device)
        self.chunk_len = torch.zeros(cap.chunks, dtype=torch.int32, device=device)
        self.alloc = {"coarse": RangeAllocator(cap.coarse), "fine": RangeAllocator(cap.fine),
                      "chunks": RangeAllocator(cap.chunks)}
        self.capacity = cap
        self.generation = 0   # bumped by every free: a request that found no room retries only after one
        self.shared: dict[object, list] = {}   # key -> [PoolRanges, references] of the shared segments
        self.live: dict[int, PoolRanges] = {}   # id -> every segment in the pools (compaction moves them)
        self.compactions = 0

    @property
    def key_vecs(self) -> int:
        """Vectors pooled from the KV per chunk for a graft: its mean key, then with boxes its keys' min and max."""
        return 3 if self.box else 1

    def nbytes(self) -> int:
        return self.capacity.nbytes(self.layers, self.heads, self.head_dim, self.box)

    def fill(self) -> dict:
        """Rows in use and capacity of each pool, for /server_info and /metrics."""
        return {kind: {"used": a.used_rows, "capacity": a.capacity} for kind, a in self.alloc.items()}

    def shared_fill(self) -> dict:
        """Shared segments in the pools and the requests' references to them."""
        return {"segments": len(self.shared), "references": sum(r for _, r in self.shared.values())}

    def acquire(self, key, load) -> PoolRanges | None:
        """The shared segment ``key``, loaded by ``load()`` (-> PoolRanges or None) if no request holds it; one
        more reference. None if it had to be loaded and found no room (``load`` may be None for a held one)."""
        got = self.shared.get(key)
        if got is None:
            rng = load()
            if rng is None:
                return None
            got = self.shared[key] = [rng, 0]
        got[1] += 1
        return got[0]

    def release(self, key) -> bool:
        """One reference less; the last frees the segment's rows (True)."""
        got = self.shared[key]
        got[1] -= 1
        if got[1] == 0:
            del self.shared[key]
            self.free(got[0])
        return got[1] == 0

    def check_range(self, rng: PoolRanges) -> None:
        """Debug mode (SPARSEKV_DEBUG=1): every row index the kernels derive from ``rng`` stays inside it.
        Reads device memory (a sync); the GPU tests run with it on."""
        cap = self.capacity
        assert 0 <= rng.coarse_at and rng.coarse_at + rng.coarse <= cap.coarse, ("coarse range", rng)
        assert 0 <= rng.fine_at and rng.fine_at + rng.fine <= cap.fine, ("fine range", rng)
        assert 0 <= rng.chunk_at and rng.chunks <= rng.chunk_rows and rng.chunk_at + rng.chunk_rows <= cap.chunks, ("chunk range", rng)
        par = self.fine_parent[:, rng.fine_at:rng.fine_at + rng.fine]
        kf = self.chunk_fine[:, rng.chunk_at:rng.chunk_at + rng.chunks]
        assert int(par.min()) >= 0 and int(par.max()) < rng.coarse, ("fine parents", rng)
        if rng.chunks:
            assert int(kf.min()) >= 0 and int(kf.max()) < rng.fine, ("chunk clusters", rng)

    def layer(self, l: int) -> tuple[CoarseRows, FineRows, ChunkRows]:
        """Views of sparse layer ``l``'s pools in the layout ``kernels/select.py`` reads."""
        return (CoarseRows(Centroids(self.coarse_mu[l], self.coarse_scale[l]), self.coarse_r[l],
                           self.coarse_tokens[l]),
                FineRows(Centroids(self.fine_mu[l], self.fine_scale[l]), self.fine_r[l], self.fine_tokens[l],
                         self.fine_parent[l]),
                ChunkRows(self.chunk_fine[l], self.chunk_start, self.chunk_len))

    def box_layer(self, l: int):
        """Sparse layer ``l``'s fine boxes [F, H, 2, d], or None without them (``kernels/select.py``)."""
        return self.fine_box[l] if self.box else None

    def view(self, co: int, fo: int, L: int) -> ClusterIndex:
        """The rows of one range as a ClusterIndex of [Ls, H, ...] tensors, coarse rows from ``co`` up to the last
        parent of its fine clusters (the parents index them); no chunk rows. Radii and counts are views (written
        through), centroids fp32 copies that :meth:`store_view` writes back. ``index.graft`` runs on it."""
        def t(x):
            return x.transpose(1, 2)

        f = slice(fo, fo + L)
        c = slice(co, co + int(self.fine_parent[:, f].max()) + 1)
        return ClusterIndex(fine_mu=t(dequantize(self.fine_mu[:, f], self.fine_scale[:, f])),
                            fine_r=t(self.fine_r[:, f]), fine_n=t(self.fine_n[:, f]),
                            fine_tokens=t(self.fine_tokens[:, f]), fine_parent=t(self.fine_parent[:, f]),
                            coarse_mu=t(dequantize(self.coarse_mu[:, c], self.coarse_scale[:, c])),
                            coarse_r=t(self.coarse_r[:, c]), coarse_n=t(self.coarse_n[:, c]),
                            coarse_tokens=t(self.coarse_tokens[:, c]), chunk_fine=t(self.chunk_fine[:, :0]),
                            fine_box=t(self._box(f)))

    def store_view(self, view: ClusterIndex, co: int, fo: int) -> None:
        """Write the centroids and boxes of :meth:`view`'s index back (unchanged rows store as they were)."""
        for codes, scale, mu, start in ((self.fine_mu, self.fine_scale, view.fine_mu, fo),
                                        (self.coarse_mu, self.coarse_scale, view.coarse_mu, co)):
            rows = slice(start, start + mu.shape[2])
            codes[:, rows], scale[:, rows] = quantize(mu.transpose(1, 2))
        if self.box:
            rows = slice(fo, fo + view.fine_box.shape[2])
            self.fine_box[:, rows] = quantize_box(view.fine_box.transpose(1, 2))

    def _box(self, f: slice) -> torch.Tensor:
        """fp32 boxes [Ls, L, H, 2, d] of fine rows ``f`` (d = 0 without boxes)."""
        return self.fine_box[:, f].float()

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        """[Ls*H, N, ...] (ClusterIndex, layer-major heads) -> [Ls, N, H, ...] (pool rows)."""
        return t.view(self.layers, self.heads, *t.shape[1:]).transpose(1, 2)

    def _join(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(self.layers * self.heads, *t.shape[1:2], *t.shape[3:])

    def load(self, packed: PackedIndex, starts: torch.Tensor, lengths: torch.Tensor, room: int) -> PoolRanges | None:
        """Copy an all-layer index over chunks at ``starts``/``lengths`` into fresh ranges; None if full."""
        ix = packed.index
        P, L, M = ix.coarse_r.shape[1], ix.fine_r.shape[1], ix.num_chunks
        rng = self._alloc(P, L, M + room)
        if rng is None:
            return None
        c, f = slice(rng.coarse_at, rng.coarse_at + P), slice(rng.fine_at, rng.fine_at + L)
        k = slice(rng.chunk_at, rng.chunk_at + M)
        for dst, src in ((self.coarse_mu, ix.coarse_mu), (self.coarse_scale, packed.coarse_scale),
                         (self.coarse_r, ix.coarse_r), (self.coarse_tokens, ix.coarse_tokens),
                         (self.coarse_n, ix.coarse_n)):
            dst[:, c] = self._split(src)
        for dst, src in ((self.fine_mu, ix.fine_mu), (self.fine_scale, packed.fine_scale), (self.fine_r, ix.fine_r),
                         (self.fine_tokens, ix.fine_tokens), (self.fine_n, ix.fine_n),
                         (self.fine_parent, ix.fine_parent)):
            dst[:, f] = self._split(src)
        if self.box:
            assert ix.has_box, "an index without fine boxes loaded into pools with them"
            self.fine_box[:, f] = self._split(ix.fine_box)
        self.chunk_fine[:, k] = self._split(ix.chunk_fine)
        self.chunk_start[k] = starts.to(torch.int32)
        self.chunk_len[k] = lengths.to(torch.int32)
        rng.chunks = M
        return rng

    def read(self, *segments: PoolRanges) -> ClusterIndex:
        """A copy of the index the segments form together, as the kernels read it (``index.union``; cluster sizes as
        stored, so a shared segment's clusters count the chunks past the ones a request shares with it)."""
        return self._gather(segments).unpack()

    def export(self, *segments: PoolRanges, lengths: torch.Tensor | None = None) -> ClusterIndex:
        """:meth:`read`, its cluster sizes counted from the chunks the segments name (``lengths``, if the caller
        has them already): the request's own index."""
        return self.export_packed(*segments, lengths=lengths).unpack()

    def export_packed(self, *segments: PoolRanges, lengths: torch.Tensor | None = None) -> PackedIndex:
        """:meth:`export` with its centroids as the pools hold them (codes and scales copied, not requantized):
        what the index cache keeps of a finished request, in one copy per field."""
        packed = self._gather(segments)
        recount(packed.index, self.lengths(*segments) if lengths is None else lengths)
        return packed

    def lengths(self, *segments: PoolRanges) -> torch.Tensor:
        """Tokens per chunk of the segments' chunks, in union order (on the device)."""
        return torch.cat([self.chunk_len[rng.chunk_at:rng.chunk_at + rng.chunks] for rng in segments])

    def _gather(self, segments: tuple[PoolRanges, ...]) -> PackedIndex:
        """The segments' rows joined in ``index.union``'s order, each field copied once: a later segment's fine
        parents count from the coarse rows before it, its chunks' clusters from the fine rows before it."""
        coarse = [slice(r.coarse_at, r.coarse_at + r.coarse) for r in segments]
        fine = [slice(r.fine_at, r.fine_at + r.fine) for r in segments]
        chunks = [slice(r.chunk_at, r.chunk_at + r.chunks) for r in segments]

        def rows(pool, slices, offsets=None):
            parts = [pool[:, s] for s in slices]
            if offsets is not None:
                parts = [p.long() + o for p, o in zip(parts, offsets)]
            return self._join(torch.cat(parts, 1))

        def before(sizes):
            return [sum(sizes[:i]) for i in range(len(sizes))]

        ix = ClusterIndex(fine_mu=rows(self.fine_mu, fine), fine_r=rows(self.fine_r, fine),
                          fine_n=rows(self.fine_n, fine), fine_tokens=rows(self.fine_tokens, fine),
                          fine_parent=rows(self.fine_parent, fine, before([r.coarse for r in segments])),
                          coarse_mu=rows(self.coarse_mu, coarse), coarse_r=rows(self.coarse_r, coarse),
                          coarse_n=rows(self.coarse_n, coarse), coarse_tokens=rows(self.coarse_tokens, coarse),
                          chunk_fine=rows(self.chunk_fine, chunks, before([r.fine for r in segments])),
                          fine_box=rows(self.fine_box, fine))
        return PackedIndex(ix, fine_scale=rows(self.fine_scale, fine), coarse_scale=rows(self.coarse_scale, coarse))

    def add_chunks(self, rng: PoolRanges, n: int) -> int | None:
        """Reserve the next ``n`` chunk rows of a range (moving it to a bigger range when it lacks room); the
        first of them, or None if the pool is full. The graft kernel (kernels/graft.py) writes the rows."""
        need = rng.chunks + n
        if need > rng.chunk_rows:
            for size in (max(2 * rng.chunk_rows, need), max(rng.chunk_rows + 64, need)):
                new = self._take("chunks", size)   # may compact the level, moving ``rng`` too
                if new is not None:
                    break
            else:
                return None
            self._move_rows("chunks", rng.chunk_at, new, rng.chunks)
            self.alloc["chunks"].free(rng.chunk_at, rng.chunk_rows)
            rng.chunk_at, rng.chunk_rows = new, size
        row = rng.chunk_at + rng.chunks
        assert need <= rng.chunk_rows and rng.chunk_at + rng.chunk_rows <= self.capacity.chunks, (n, rng)
        rng.chunks = need
        return row

    def _alloc(self, P: int, L: int, K: int) -> PoolRanges | None:
        got = []
        for kind, n in (("coarse", P), ("fine", L), ("chunks", K)):
            start = self._take(kind, n)
            if start is None:
                for (k, s, m) in got:
                    self.alloc[k].free(s, m)
                return None
            got.append((kind, start, n))
        (_, co, _), (_, fo, _), (_, ko, _) = got
        rng = PoolRanges(co, P, fo, L, ko, 0, K)
        self.live[id(rng)] = rng
        return rng

    def _take(self, kind: str, n: int) -> int | None:
        """``n`` rows of one level: first fit, else, where the level's free rows add up to ``n`` but lie apart, after
        :meth:`compact` made them one range. None only when the level really lacks the rows."""
        a = self.alloc[kind]
        start = a.alloc(n)
        if start is None and a.free_rows >= n:
            self.compact(kind)
            start = a.alloc(n)
        return start

    def compact(self, kind: str) -> None:
        """Move every segment's rows of one level to the front of its pool, in their order, so its free rows become
        one range. Each segment's ``PoolRanges`` is updated in place, so the requests and shared segments holding it
        follow (their rows are local: parents and chunk clusters count from their segment's first row). The copies
        queue on the current stream behind the steps that read the old rows; a decode step's table is built after."""
        at, size = LEVEL_ROWS[kind]
        end = 0
        for rng in sorted(self.live.values(), key=lambda r: getattr(r, at)):
            start, rows = getattr(rng, at), getattr(rng, size)
            if start != end:   # rows past a chunk range's recorded ones are empty
                self._move_rows(kind, start, end, rng.chunks if kind == "chunks" else rows)
                setattr(rng, at, end)
            end += rows
        self.alloc[kind].compacted(end)
        self.compactions += 1

    def _move_rows(self, kind: str, src: int, dst: int, n: int) -> None:
        """Copy ``n`` rows of one level from row ``src`` to row ``dst`` in every tensor of that level (the two
        ranges may overlap)."""
        tensors = {"coarse": (self.coarse_mu, self.coarse_scale, self.coarse_r, self.coarse_tokens, self.coarse_n),
                   "fine": (self.fine_mu, self.fine_scale, self.fine_r, self.fine_tokens, self.fine_n,
                            self.fine_parent, self.fine_box),
                   "chunks": (self.chunk_fine, self.chunk_start.view(1, -1), self.chunk_len.view(1, -1))}[kind]
        for t in tensors:
            t[:, dst:dst + n] = t[:, src:src + n].clone()

    def free(self, rng: PoolRanges) -> None:
        self.alloc["coarse"].free(rng.coarse_at, rng.coarse)
        self.alloc["fine"].free(rng.fine_at, rng.fine)
        self.alloc["chunks"].free(rng.chunk_at, rng.chunk_rows)
        del self.live[id(rng)]
        self.generation += 1
