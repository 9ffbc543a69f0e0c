"""Speculative decoding with n-gram drafts (prompt lookup): several tokens a decode step.

A decode step on a CPU (and at small batches on a GPU) is bound by reading the weights, so a
step that computes a few more rows of one sequence costs little more than its one token. The
proposer guesses a sequence's next tokens from its own history: the longest suffix of
``prompt_lookup_min .. prompt_lookup_max`` tokens that occurred before, latest occurrence
first, and the (up to) ``num_speculative_tokens`` tokens that followed it. Summaries,
edits, code and retrieval answers copy spans of their prompts, so such guesses are often
right.

The step then computes the sequence's last token and the draft as rows of one batch (each
attends over the KV before it, the draft's earlier rows included) and samples every row as
its own request, with the row's history, draft tokens included, for penalties, ``min_tokens``
and bad words. The sequence keeps tokens while the sampled one equals the draft's, and the
first that does not (or, all accepted, the row after the draft: a bonus token)::

    computed rows   t   d0   d1   d2          sampled   s0 == d0, s1 == d1, s2 != d2
    kept            d0  d1   s2               KV kept   t, d0, d1 (s2 is computed next)

This is exact, not an approximation: the kept token at each position is a draw from the
model's own distribution there, given the tokens kept before it. For a draft that is one
token (not a distribution), accepting while the draw equals it is the optimal acceptance rule
of speculative sampling (accept ``d`` with probability ``p(d)``, else draw from ``p`` without
``d``). Greedy outputs equal those without speculation, up to the rounding of a batch of
different shape; a seeded request stays reproducible, but draws once per computed row, so its
tokens differ from the same seed's without speculation.

Rejected drafts' KV is left in their slots and overwritten by the next step; the sequence's
blocks past its kept tokens go back to the pool (``BlockManager.trim``).

Set by ``EngineConfig.speculative_config`` (``config.SpeculativeConfig``, vLLM's keys).

Rows with a grammar (structured outputs) draft too: row j is masked by the grammar's state
after the draft's first j tokens (``structured.draft_masks``: accept, fill, roll back), and
the kept tokens advance the matcher. No drafts in a step once ``disable_by_batch_size``
sequences run (a step of that many rows is no longer bound by the weights' bytes).
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A sequence's tokens as a growing int64 array (the lookup's input), appended to
    rather than rebuilt each step."""

    __slots__ = ("_buf", "_len")

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int64)
        self._len = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self._len:  # truncated (a stop string): start over
            self._len = 0
        if n > self._buf.shape[0]:
            grown = np.empty(max(n, 2 * self._buf.shape[0], 64), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len : n] = token_ids[self._len : n]
            self._len = n
        return self._buf[:n]


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n .. max_n`` tokens; [] when no such suffix occurred before."""
    size = tokens.shape[0]
    if size <= min_n or k < 1:
        return []
    # ends of earlier occurrences: positions before the last whose token is the last token
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched at each end
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, max_n):
        back = ends - j
        ok = alive & (back >= 0)
        ok[ok] = tokens[back[ok]] == tokens[size - 1 - j]
        alive = ok
        if not alive.any():
            break
        matched[alive] += 1
    best = matched.max()
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest
    return tokens[end + 1 : end + 1 + k].tolist()


def accepted(draft: tuple[int, ...], sampled: list[int]) -> int:
    """How many rows' tokens a sequence keeps: the sampled ones while they equal the draft's,
    and the first that does not (``len(sampled) == len(draft) + 1``)."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n + 1
