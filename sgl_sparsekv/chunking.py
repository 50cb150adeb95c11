"""Structure-aware chunking (LycheeCluster section 4.3, appendix B) and fixed pages.

Every token id gets, once per tokenizer, the strength of a cut right after it:
4 structural (blank line, Markdown fence or rule, closing } ] >), 3 sentence end (. ? ! and
the CJK full stops, single newline), 2 phrase mark (, ; : and CJK marks), 1 whitespace,
0 nothing. Whitespace also counts when the *next* token starts with a space, so the decision
for a chunk starting at ``s`` reads tokens ``s .. s + chunk_max`` (one token of lookahead).

A chunk grows to ``chunk_min`` tokens, then cuts after the strongest boundary among its
tokens ``chunk_min .. chunk_max`` (ties: the earliest); with none, it cuts at ``chunk_max``.
Chunks are emitted only once their whole decision window is known, which makes the chunk
sequence a pure function of the token sequence: prefill, decode-time packing and a radix
cache hit on a shared prefix all produce the same chunks.
"""

from __future__ import annotations

import numpy as np
import torch

NONE, SPACE, PHRASE, SENTENCE, STRUCT = 0, 1, 2, 3, 4

_STRUCT_MARKS = ("```", "---", "***", "}", "]", ">")
_SENTENCE_MARKS = (".", "?", "!", "。", "？", "！", "\n")
# windows of at most this many tokens (a decode step's) are cut in plain Python, longer ones with numpy
SHORT = 64

_PHRASE_MARKS = (",", ";", ":", "，", "；", "：", "、", "·")


def text_strength(text: str) -> int:
    """Strength of a cut right after a token whose decoded text is ``text``."""
    if "\n\n" in text or any(m in text for m in _STRUCT_MARKS):
        return STRUCT
    if any(m in text for m in _SENTENCE_MARKS):
        return SENTENCE
    if any(m in text for m in _PHRASE_MARKS):
        return PHRASE
    if text[-1:].isspace():
        return SPACE
    return NONE


class BoundaryTable:
    """Per-token-id cut strength and leading-whitespace flag, computed once per tokenizer."""

    def __init__(self, strength: np.ndarray, leading_space: np.ndarray):
        self.strength = strength.astype(np.int8)
        self.leading_space = leading_space.astype(bool)

    @classmethod
    def from_texts(cls, texts: list[str]) -> "BoundaryTable":
        strength = np.array([text_strength(t) for t in texts], dtype=np.int8)
        lead = np.array([t[:1].isspace() for t in texts], dtype=bool)
        return cls(strength, lead)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> "BoundaryTable":
        n = max(len(tokenizer), vocab_size or 0)
        texts = []
        for i in range(n):
            try:
                piece = tokenizer.convert_ids_to_tokens(i)
                text = tokenizer.decode([i]) if piece is not None else ""
            except Exception:
                piece, text = None, ""
            # SentencePiece and byte-level BPE mark a leading space in the raw piece; decode() of
            # a single token may strip it.
            if isinstance(piece, str) and piece[:1] in ("▁", "Ġ") and not text[:1].isspace():
                text = " " + text
            texts.append(text or "")
        return cls.from_texts(texts)

    def cut_strength(self, token_ids: np.ndarray) -> np.ndarray:
        """Strength of a cut after each token; the last token's whitespace rule needs its successor."""
        ids = np.asarray(token_ids, dtype=np.int64)
        ids = np.clip(ids, 0, len(self.strength) - 1)
        s = self.strength[ids].copy()
        nxt_space = np.zeros(len(ids), dtype=bool)
        nxt_space[:-1] = self.leading_space[ids[1:]]
        s[(s < SPACE) & nxt_space] = SPACE
        return s


def structure_cuts(strength: np.ndarray, n_tokens: int, chunk_min: int, chunk_max: int,
                   final: bool = False) -> np.ndarray:
    """Chunk end offsets (exclusive) over ``strength`` (cut strength after each token).

    Emits a chunk only when its decision window ``[s, s + chunk_max]`` lies inside the
    ``n_tokens`` known tokens, unless ``final`` (then the tail is cut too; used by tests and
    offline analysis, never on the serving path).
    """
    strength = np.asarray(strength[:n_tokens], dtype=np.int16)
    n = n_tokens
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # best[s]: the cut (exclusive end) a chunk starting at s would take. One vectorized pass
    # over all starts; the greedy chain below then only hops from chunk to chunk.
    width = chunk_max - chunk_min + 1
    pad = np.full(n + chunk_max + 1, -1, dtype=np.int16)
    pad[:n] = strength
    # window for start s covers tokens s+chunk_min-1 .. s+chunk_max-1 (cut after them)
    win = np.lib.stride_tricks.sliding_window_view(pad[chunk_min - 1:], width)[:n]
    arg = win.argmax(axis=1)  # first maximum: ties go to the earliest cut
    top = win[np.arange(n), arg]
    best = np.where(top > NONE, np.arange(n) + chunk_min + arg, np.arange(n) + chunk_max)
    ends = []
    s = 0
    best_l = best.tolist()
    while True:
        if s + chunk_max + 1 > n:  # decision window not complete
            if final and s < n:
                ends.append(min(best_l[s], n))
            break
        e = best_l[s]
        ends.append(e)
        s = e
    return np.asarray(ends, dtype=np.int64)


def fixed_cuts(n_tokens: int, size: int, final: bool = False) -> np.ndarray:
    """Fixed-size units (Quest pages, or the fixed-chunk ablation): emitted once full."""
    full = n_tokens // size
    ends = np.arange(1, full + 1, dtype=np.int64) * size
    if final and n_tokens % size:
        ends = np.append(ends, n_tokens)
    return ends


class Chunker:
    """Cuts a token stream into retrieval units for one method (lychee chunks or quest pages)."""

    def __init__(self, mode: str, chunk_min: int, chunk_max: int, table: BoundaryTable | None):
        if mode == "structure" and table is None:
            raise ValueError("structure-aware chunking needs a tokenizer boundary table")
        self.mode, self.chunk_min, self.chunk_max, self.table = mode, chunk_min, chunk_max, table
        if table is not None:   # as Python lists, for the short windows of decode steps
            self._strength, self._lead = table.strength.tolist(), table.leading_space.tolist()

    @property
    def lookahead(self) -> int:
        """Tokens needed past a unit's start before it can be cut."""
        return self.chunk_max + 1 if self.mode == "structure" else self.chunk_max

    def cuts(self, token_ids, final: bool = False) -> np.ndarray:
        """Exclusive end offsets of the units that ``token_ids`` (a unit-aligned stream) completes."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.cpu().numpy()
        n = len(token_ids)
        if self.mode == "fixed":
            return fixed_cuts(n, self.chunk_max, final)
        if n <= SHORT:
            return np.asarray(self._structure_cuts_short(token_ids, final), dtype=np.int64)
        return structure_cuts(self.table.cut_strength(token_ids), n, self.chunk_min, self.chunk_max, final)

    def ends(self, token_ids: list[int]) -> list[int]:
        """``cuts`` of a host token list, as a list: a decode step's short window takes no numpy call (with cold
        caches, as a served step starts, each costs tens of microseconds)."""
        if self.mode == "structure" and len(token_ids) <= SHORT:
            return self._structure_cuts_short(token_ids, False)
        return self.cuts(token_ids).tolist()

    def _structure_cuts_short(self, ids, final: bool) -> list[int]:
        """``structure_cuts(table.cut_strength(ids))`` in plain Python, for the few tokens a decode step cuts
        from (a numpy call costs more than the whole window here)."""
        st, lead, top_id = self._strength, self._lead, len(self._strength) - 1
        n, lo, hi = len(ids), self.chunk_min, self.chunk_max

        def best(s: int) -> int:
            """The first strongest cut after tokens s+lo-1 .. s+hi-1 (none past the end; s+hi if all are NONE): only
            those tokens' strengths are read, each with its successor's leading space."""
            top, end = NONE, s + hi
            for j in range(s + lo - 1, min(s + hi, n)):
                v = st[min(max(int(ids[j]), 0), top_id)]
                if v < SPACE and j + 1 < n and lead[min(max(int(ids[j + 1]), 0), top_id)]:
                    v = SPACE
                if v > top:
                    top, end = v, j + 1
            return end

        ends, s = [], 0
        while s + hi + 1 <= n:
            ends.append(best(s))
            s = ends[-1]
        if final and s < n:
            ends.append(min(best(s), n))
        return ends

