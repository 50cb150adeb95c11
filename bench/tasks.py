"""Seeded long-context task generators (no downloads): each returns (prompt, expected answer)."""

from __future__ import annotations

import random

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def passkey(tokenizer, n_tokens: int, depth: float, seed: int = 0) -> tuple[str, str]:
    """Filler text of about ``n_tokens`` tokens with a pass key hidden at ``depth`` (0..1)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    head = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n")
    tail = "\nWhat is the pass key? The pass key is"
    per = max(1, len(tokenizer.encode(FILLER, add_special_tokens=False)))
    budget = n_tokens - len(tokenizer.encode(head + needle + tail, add_special_tokens=False))
    reps = max(1, budget // per)
    before = int(reps * depth)
    text = head + FILLER * before + needle + FILLER * (reps - before) + tail
    return text, key
