"""Prompt-lookup drafts: the tokens that followed an earlier occurrence of a sequence's own
suffix (its prompt plus output), the speculative decoder's only draft source.

Answers that quote their prompt (editing code, summarising, RAG) repeat long runs of it; when
the last `n` tokens also occur earlier, the tokens after that occurrence are a good guess at
what comes next, found without a second model.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` whose length is in `[ngram_min, ngram_max]`; [] when no such suffix recurs."""
    length = len(tokens)
    if k < 1 or length <= ngram_min:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    # Candidate ends: earlier positions holding the last token (the suffix itself excluded).
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched backwards from each end
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(ngram_max, length - 1)):
        alive &= ends >= back
        alive[alive] = seq[ends[alive] - back] == seq[-1 - back]
        if not alive.any():
            break
        matched[alive] += 1
    good = np.flatnonzero(matched >= ngram_min)
    if good.size == 0:
        return []
    longest = matched[good].max()
    end = int(ends[good[matched[good] == longest][-1]])  # the most recent of the longest matches
    return seq[end + 1 : end + 1 + k].tolist()
