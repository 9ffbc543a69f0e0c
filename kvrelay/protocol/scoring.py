"""Scoring text pairs (vLLM's ``/score`` and ``/rerank``, ``LLM.score``), torch-free: the
router and the offline ``LLM`` share it.

Two ways, chosen by the model:

- a **cross-encoder** (a sequence classifier with one label, ``ClassifierConfig.
  scores_pairs``) reads each (query, document) pair as one input, joined by the tokenizer's
  pair template, and its activated logit is the score;
- an **embedding model** (any other decoder kvrelay serves) embeds every text once and a
  pair's score is the cosine of the two vectors.

Pairs are 1:1, 1:N (one query against every document) or N:N (the i-th against the i-th).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrelay.protocol.pooling import ClassifierConfig


class ScoringError(ValueError):
    """Pairs or a model that cannot be scored (the message says why)."""


def pair_indices(num_queries: int, num_documents: int) -> list[tuple[int, int]]:
    """(query, document) index pairs: 1:N pairs the one query with each document."""
    if num_queries == 0 or num_documents == 0:
        raise ScoringError("scoring needs at least one query and one document")
    if num_queries == 1:
        return [(0, j) for j in range(num_documents)]
    if num_queries != num_documents:
        raise ScoringError(
            f"got {num_queries} queries and {num_documents} documents: pairs are 1:1, 1:N or N:N"
        )
    return [(i, i) for i in range(num_queries)]


def cross_encodes(classifier: ClassifierConfig | None, architecture: str = "") -> bool:
    """Whether pairs are read by the model as one input (a one-label classifier) rather
    than embedded apart; raises ScoringError for a classifier of several labels, which
    has no pair score."""
    if classifier is None:
        return False
    if not classifier.scores_pairs:
        raise ScoringError(
            f"this model{f' ({architecture})' if architecture else ''} classifies into"
            f" {classifier.num_labels} labels; scoring pairs needs one label (a"
            " cross-encoder) or an embedding model"
        )
    return True


def cosine(first: Sequence[float] | np.ndarray, second: Sequence[float] | np.ndarray) -> float:
    """The cosine similarity of two vectors, in float64 (0.0 when one is zero)."""
    a = np.asarray(first, dtype=np.float64)
    b = np.asarray(second, dtype=np.float64)
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norm if norm else 0.0
