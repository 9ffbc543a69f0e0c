"""The filters of a sampled row (top-k, top-p, min-p), over the vocabulary or its candidates.

``Sampler._sample`` (``sampling.py``) divides each row by its temperature, then keeps, per row,
the tokens its ``top_k``, ``top_p`` and ``min_p`` allow and sets the others to -inf. Rows
whose filters are decided within their ``FILTER_CANDIDATES`` best tokens are ranked over
those only (``filter_candidates``); the others over the whole vocabulary (``filter_whole``:
a sort for top-k, value bins for top-p, ``_filter_nucleus``). ``filter_logits`` is the
reference the tests hold both against: stably sorted, ties to the lowest id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def as_column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def as_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


FILTER_CANDIDATES = 256  # tokens ``filter_logits`` ranks before it filters a row whole


def filter_logits(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """Returns a new [M, V] tensor with tokens outside each row's kept set at -inf.

    Works in stably sorted order, so equal logits keep the lowest id first: top-k keeps exactly
    the first k (k <= 0: all); top-p keeps a token while the probability mass (after top-k)
    before it is below p; min-p drops tokens whose probability is below min_p times the most
    likely token's. The most likely token always survives.
    """
    keep = keep_counts(top_k, logits.shape[1])
    candidates, _, undecided = split_by_candidates(logits, keep, top_p, min_p)
    if candidates is None:
        return filter_whole(logits, keep, top_p, min_p)
    values, ids = candidates
    out = torch.full_like(logits, -math.inf).scatter_(1, ids, values)
    if undecided:
        rows = as_index(undecided, logits.device)
        out[rows] = filter_whole(logits[rows], *pick(undecided, keep, top_p, min_p))
    return out


def split_by_candidates(
    logits: torch.Tensor, keep: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[int], list[int]]:
    """``filter_candidates``' (values, ids) (None where it takes none), and the rows they
    decide and the rows that need the whole row (``_filter_whole``)."""
    candidates = filter_candidates(logits, keep, top_p, min_p)
    if candidates is None:
        return None, [], list(range(len(keep)))
    values, ids, decided = candidates
    flags = decided.tolist()
    return (
        (values, ids),
        [i for i, d in enumerate(flags) if d],
        [i for i, d in enumerate(flags) if not d],
    )


def keep_counts(top_k: Sequence[int], vocab_size: int) -> list[int]:
    """Tokens each row's top-k keeps (the vocabulary where it keeps all)."""
    return [k if 0 < k < vocab_size else vocab_size for k in top_k]


def pick(rows: Sequence[int], *columns: Sequence[Any]) -> list[list[Any]]:
    return [[column[i] for i in rows] for column in columns]


def filter_candidates(
    logits: torch.Tensor, keep: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``filter_logits`` on each row's largest ``FILTER_CANDIDATES`` logits (more where a
    top-k keeps more): ``(values, ids, decided)``, [M, W] logits with the dropped at -inf, their
    token ids, and [M] whether the row's kept tokens are all among them (a flat distribution
    under top-p 0.99 is not: `filter_logits` filters such a row whole). None where W would be a
    quarter of the vocabulary or more. A stable sort of [32, 49,152] logits took 62 ms on CPU,
    the candidates ~3 (BENCHMARKS.md "Sampling").

    Exact: the candidates are put in the row's stable order (by id, then stably by value);
    the first ``exact`` + 1 of them are the row's first in that order by position and value
    (later ones may tie with a lower id left out, but have the same value: so the top-k's
    mass, its first k < W values, is the row's too), and each filter drops a suffix, deciding
    by position, by the mass before a position, or by value; so a row whose first dropped
    position is at most ``exact`` is decided; so is a row whose W-th candidate is -inf (a
    grammar's mask): every token outside is -inf whether kept or dropped.
    """
    vocab_size = logits.shape[1]
    width = max([FILTER_CANDIDATES] + [k + 1 for k in keep if k < vocab_size])
    if 4 * width >= vocab_size:
        return None
    values, ids = logits.topk(width, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    exact = (values > values[:, -1:]).sum(dim=-1)
    keep_k = as_index(keep, logits.device)
    total = _totals(logits, values, keep_k)
    removed = _removed(values, _probs(values, total), keep_k, top_p, min_p)
    first = torch.where(removed.any(dim=-1), removed.int().argmax(dim=-1), width)
    # a row with fewer finite logits than candidates (a grammar's mask) has them all here
    decided = (first <= exact) | (values[:, -1] == -math.inf)
    return values.masked_fill(removed, -math.inf), ids, decided


def _first_logsumexp(values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp of its first ``count`` values."""
    position = torch.arange(values.shape[1], device=values.device)
    return values.masked_fill(position >= count.unsqueeze(1), -math.inf).logsumexp(dim=-1)


def _totals(logits: torch.Tensor, ordered: torch.Tensor, keep_k: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp over what its top-k keeps: the first ``keep_k`` of its stably
    ordered values ``ordered`` (the candidates, or the whole sorted row), the whole row where
    it has no top-k."""
    total = _row_logsumexp(logits)
    has_k = keep_k < logits.shape[1]
    if bool(has_k.any()):
        first = _first_logsumexp(ordered, keep_k.clamp(max=ordered.shape[1]))
        total = torch.where(has_k, first, total)
    return total


def _row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp, on the row in id order: every path to a kept set (candidates,
    value bins, the whole sort) takes it from there, so a token's probability (``_probs``)
    is the same number in each."""
    return logits.logsumexp(dim=-1)


def _probs(logits: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Each token's probability from its logit and its row's log-sum-exp, as float64 for
    the masses: the paths add the same probabilities in different orders, so in float64
    they agree but where a mass lies within ~1e-12 of p (float32 sums drift by ~1e-6 over a
    vocabulary). Computed in float32: float64 ``exp`` is ~15x slower on CPU."""
    return (logits - total.unsqueeze(1)).exp().double()


def _removed(
    sorted_logits: torch.Tensor,
    probs: torch.Tensor,
    keep_k: torch.Tensor,
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Positions of rows in stable descending order that top-k, top-p or min-p drops;
    ``probs`` are the positions' probabilities over the top-k (all tokens without one)."""
    device = sorted_logits.device
    position = torch.arange(sorted_logits.shape[1], device=device)
    removed = position >= keep_k.unsqueeze(1)
    probs = probs.masked_fill(removed, 0.0)
    p = as_column(top_p, device)
    mass_before = probs.cumsum(dim=-1) - probs
    removed |= (mass_before >= p) & (p < 1)
    return removed | _below_min_p(sorted_logits, sorted_logits[:, :1], min_p)


def _below_min_p(logits: torch.Tensor, top: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Tokens whose probability is below min_p times the most likely token's (``top``, its
    logit): a threshold on the logit."""
    log_min_p = as_column(min_p, logits.device).log()  # log(0) = -inf keeps everything
    return logits < top + log_min_p


def filter_whole(
    logits: torch.Tensor, keep: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """``filter_logits`` over whole rows: rows with a top-k sort (``_filter_sorted``), rows
    with a top-p and no top-k find their edge by value bins (``_filter_nucleus``), min-p
    alone is a threshold on the value (``_filter_min_p``)."""
    vocab_size = logits.shape[1]
    groups = (
        ([i for i, k in enumerate(keep) if k < vocab_size], _filter_sorted),
        (
            [i for i, (k, p) in enumerate(zip(keep, top_p)) if k >= vocab_size and p < 1],
            _filter_nucleus,
        ),
        (
            [i for i, (k, p) in enumerate(zip(keep, top_p)) if k >= vocab_size and p >= 1],
            _filter_min_p,
        ),
    )
    for rows, filter_rows in groups:
        if len(rows) == len(keep):
            return filter_rows(logits, keep, top_p, min_p)
    out = torch.empty_like(logits)
    for rows, filter_rows in groups:
        if rows:
            at = as_index(rows, logits.device)
            out[at] = filter_rows(logits[at], *pick(rows, keep, top_p, min_p))
    return out


def _filter_sorted(
    logits: torch.Tensor, keep: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """``filter_logits`` over each row's whole stable sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    keep_k = as_index(keep, logits.device)
    total = _totals(logits, sorted_logits, keep_k)
    removed = _removed(sorted_logits, _probs(sorted_logits, total), keep_k, top_p, min_p)
    kept = sorted_logits.masked_fill(removed, -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(1, order, kept)


def _filter_min_p(
    logits: torch.Tensor, keep: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """``filter_logits`` for rows with neither a top-k nor a top-p."""
    top = logits.amax(dim=-1, keepdim=True)
    return logits.masked_fill(_below_min_p(logits, top, min_p), -math.inf)


NUCLEUS_BINS = 4096  # value bins of ``_filter_nucleus``
NUCLEUS_SPAN = 48.0  # logits below the row's largest that the bins cover; the rest, the last


def _filter_nucleus(
    logits: torch.Tensor, keep: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """``filter_logits`` for rows with a top-p and no top-k, where the candidates did not
    decide them (a flat distribution: top-p 0.9 keeps thousands of tokens), without sorting
    the row: a stable sort of [32, 49,152] took ~85 ms of such a step on CPU.

    Top-p keeps, in stable descending order, every token whose mass before it is below p:
    all tokens above some value, and a first few by id of the tokens at it. The row's values
    fall into ``NUCLEUS_BINS`` bins of equal width from its largest down to ``NUCLEUS_SPAN``
    below it, and everything lower into the last (a bin index is monotone in the value, so
    equal values share a bin); the bins' masses are added up: the bins before the one where
    the cumulative mass reaches p are kept whole, those after it dropped, and only the
    tokens of that edge bin are ranked (by value, then id), their mass before counted from
    the bins above. Exact as the sort is, but for the order in which the float64 masses are
    added (``_probs``). The last bin is an edge only under p within 1e-15 of 1 (a token
    e^-48 as likely as the first, times the vocabulary); then it is ranked whole.
    """
    num_rows = logits.shape[0]
    device = logits.device
    values = logits.float()
    top = values.amax(dim=-1, keepdim=True)
    bins = ((top - values) * (NUCLEUS_BINS / NUCLEUS_SPAN)).clamp_(max=NUCLEUS_BINS - 1).long()
    probs = _probs(values, _row_logsumexp(values))
    mass = probs.new_zeros(num_rows, NUCLEUS_BINS).scatter_add_(1, bins, probs)
    cumulative = mass.cumsum(dim=-1)
    p = as_column(top_p, device)
    edge = (cumulative < p).sum(dim=-1, keepdim=True).clamp_(max=NUCLEUS_BINS - 1)
    above = torch.where(edge > 0, cumulative.gather(1, (edge - 1).clamp(min=0)), 0.0)
    at_edge = bins == edge
    width = int(at_edge.sum(dim=-1).max())
    # the edge bin's tokens in stable descending order (other tokens fill rows with fewer)
    edge_values, ids = torch.where(at_edge, values, -math.inf).topk(width, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    _, order = edge_values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    in_edge = at_edge.gather(1, ids)
    edge_probs = probs.gather(1, ids).masked_fill_(~in_edge, 0.0)
    mass_before = above + edge_probs.cumsum(dim=-1) - edge_probs
    kept = bins < edge
    kept.scatter_(1, ids, kept.gather(1, ids) | (in_edge & (mass_before < p)))
    kept &= ~_below_min_p(values, top, min_p)
    return logits.masked_fill(~kept, -math.inf)
