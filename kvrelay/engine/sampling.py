"""Per-step token sampling: a batched sampler over ``SamplingParams`` (``sampling_params.py``).

One step's logits (one row per request) go through, in this order::

    raw logits ──► grammar mask (rows with a matcher: refused tokens at -inf, as vLLM does)
        │
        ├──► logprobs: log_softmax of these logits (vLLM's default ``raw_logprobs``; under a
        │    grammar they are the model's distribution renormalised over allowed tokens)
        │
        ├─ allowed_token_ids: every other token at -inf
        ├─ logit_bias: added to its tokens' logits
        ├─ penalties: repetition (prompt + output tokens), then frequency, presence (output)
        ├─ min_tokens: eos ids and stop_token_ids set to -inf while the output is too short
        ├─ bad words: a word's last id set to -inf while the output ends with the rest
        ├─ greedy rows ──► argmax (ties: lowest id)
        └─ other rows  ──► / temperature ──► top_k ──► top_p ──► min_p ──► draw

A row whose request carries its own ``torch.Generator`` draws only from it, exactly one uniform
number per step (``inverse_cdf``), so a seeded request gets the same tokens
whatever else is in the batch and wherever its row is. Rows without one share the sampler's
generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from kvrelay.engine.sampling_filters import (
    as_column,
    as_index,
    filter_whole,
    keep_counts,
    pick,
    split_by_candidates,
)
from kvrelay.protocol.sampling_params import (
    SamplingParams,
    TokenLogprobs,
)


def create_generator(
    params: SamplingParams, device: torch.device | str = "cpu", drawn: int = 0
) -> torch.Generator | None:
    """Returns a generator seeded with ``params.seed``, or None when the request has no seed.

    The caller owns it for the life of the sequence and passes it in every step's
    ``SampleRequest``; sequences that must differ (``n > 1``) need their own seeds.
    ``drawn``: tokens the request already has (sampled in another process: a decode worker
    goes on from the prefill worker's first token, a re-run from what was streamed). A sampled
    row takes exactly one uniform number a token, so the generator skips that many, as the
    process that drew them left it: the same tokens colocated, 1P+1D and after a re-run.
    """
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    if drawn and not params.is_greedy:
        scratch = torch.empty(1, dtype=torch.float64, device=device)
        for _ in range(drawn):  # one at a time, as _uniforms draws them
            scratch.uniform_(generator=generator)
    return generator


class SampleRequest(NamedTuple):
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # the request's own (seeded); None: the shared one
    matcher: Any = None  # an xgrammar GrammarMatcher at this step's state; None: no grammar


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def _flat_ids(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab_size + id`` of every id (ids >= vocab_size dropped), one tensor."""
    flat = [
        row * vocab_size + t for row, ids in enumerate(token_ids) for t in ids if t < vocab_size
    ]
    return torch.tensor(flat, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Returns a new [M, V] tensor: ``logits`` with each row's request penalties applied.

    Repetition (HF / vLLM): a token seen in the prompt or the output has a positive logit
    divided by the penalty and a negative one multiplied. Then, for output tokens only,
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

    Touches only the tokens seen (gathered, changed, written back), not [M, V] counts: a
    32-row step with 300-token prompts and 60 output tokens each spent 23-33 ms on dense
    counts and masks (BENCHMARKS.md "Sampling").
    """
    vocab_size, device = logits.shape[1], logits.device
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    repetition = [r.params.repetition_penalty for r in requests]
    if any(value != 1 for value in repetition):
        seen_ids = [
            [*r.prompt_token_ids, *r.output_token_ids] if r.params.repetition_penalty != 1 else ()
            for r in requests
        ]
        seen = _flat_ids(seen_ids, vocab_size, device).unique()
        factor = as_column(repetition, device).squeeze(1)[seen // vocab_size]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    output, counts = _flat_ids([r.output_token_ids for r in requests], vocab_size, device).unique(
        return_counts=True
    )
    if output.numel():
        row = output // vocab_size
        frequency = as_column([r.params.frequency_penalty for r in requests], device).squeeze(1)
        presence = as_column([r.params.presence_penalty for r in requests], device).squeeze(1)
        flat[output] = flat[output] - frequency[row] * counts.to(out.dtype) - presence[row]
    return out


def greedy_ids(scores: torch.Tensor) -> torch.Tensor:
    """The highest-scoring id of each row, the lowest id on a tie. ``max`` gives the same ids
    as ``argmax`` (first maximum) and on CPU runs 2-3x faster over a [64, 49152] batch."""
    return scores.max(dim=-1).indices


INVERSE_CDF_BLOCK = 128  # tokens per block of ``inverse_cdf``'s first search


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token for its uniform ``u`` in [0, 1): the first whose cumulative probability
    exceeds ``u`` times the row's total, so a token of probability 0 is never chosen. One draw
    per row; the exponential race this replaced drew noise for the whole [rows, vocab], 30 of a
    32-row step's 40 ms of sampling on CPU (BENCHMARKS.md "Sampling").

    Wide rows search twice: blocks of ``INVERSE_CDF_BLOCK`` tokens by their sums (float32 sums,
    float64 cumulative), then the chosen block's tokens (float64), instead of a float64 cumsum
    of the whole row (~4 ms of a 32-row step, against ~0.1).
    """
    num_rows, width = probs.shape
    row = torch.arange(num_rows, device=probs.device)
    if width < 16 * INVERSE_CDF_BLOCK or width % INVERSE_CDF_BLOCK:
        return _search(probs.double().cumsum(dim=-1), uniform * probs.double().sum(dim=-1))
    blocks = probs.view(num_rows, width // INVERSE_CDF_BLOCK, INVERSE_CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = uniform * block_cdf[:, -1]
    block = _search(block_cdf, target)
    before = torch.where(block > 0, block_cdf[row, (block - 1).clamp(min=0)], 0.0)
    within = blocks[row, block].double().cumsum(dim=-1) + before.unsqueeze(1)
    return block * INVERSE_CDF_BLOCK + _search(within, target.clamp(min=before))


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first position of each row of ``cdf`` (non-decreasing) above its target, the target
    kept below the row's last value (rounding) so that one always is."""
    last = cdf[:, -1]
    target = torch.minimum(target, torch.nextafter(last, torch.zeros_like(last)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[SampleRequest]
) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens and the top alternatives, from the raw ``logits``."""
    result: list[TokenLogprobs | None] = [None] * len(requests)
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not wanted:
        return result
    rows = as_index(wanted, logits.device)
    tops = [requests[i].params.logprobs or 0 for i in wanted]
    for i, entry in zip(wanted, token_logprobs(logits[rows], token_ids[rows], tops)):
        result[i] = entry
    return result


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, tops: Sequence[int]
) -> list[TokenLogprobs]:
    """Row i's logprob of ``token_ids[i]``, its rank and the row's top ``tops[i]``."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    # counted in int32: torch's default int64 sum over a bool row took twice as long (256 x
    # 49,152: 41 against 21 ms), as long as the log_softmax itself
    ranks = (logprobs > chosen).sum(dim=-1, dtype=torch.int32) + 1
    top_values, top_ids = logprobs.topk(min(max(tops), logprobs.shape[1]), dim=-1)
    columns = (token_ids, chosen.squeeze(1), ranks, top_ids, top_values)
    return [
        TokenLogprobs(token_id, logprob, rank, tuple(zip(ids[:k], values[:k])))
        for k, (token_id, logprob, rank, ids, values) in zip(
            tops, zip(*(column.tolist() for column in columns))
        )
    ]


def shape_logits(scores: torch.Tensor, rows: Sequence[tuple[int, SamplingParams]]) -> None:
    """Applies each row's allowed_token_ids (every other token to -inf), then its logit_bias
    (added), to ``scores`` in place; ``rows`` are (row, params) with either set."""
    device = scores.device
    allowed = [(row, p.allowed_token_ids) for row, p in rows if p.allowed_token_ids is not None]
    if allowed:  # the allowed values out, the rows to -inf, the values back
        index = as_index([row for row, _ in allowed], device).unsqueeze(1)
        width = max(len(ids) for _, ids in allowed)  # shorter lists repeat their first id
        padded = [[*ids, *[ids[0]] * (width - len(ids))] for _, ids in allowed]
        ids = torch.tensor(padded, dtype=torch.long, device=device)
        kept = scores[index, ids]
        scores.index_fill_(0, index.squeeze(1), -math.inf)
        scores[index, ids] = kept
    biased = [(row, p.logit_bias) for row, p in rows if p.logit_bias]
    if biased:
        at = (
            as_index([row for row, bias in biased for _ in bias], device),
            as_index([t for _, bias in biased for t, _ in bias], device),
        )
        values = [float(b) for _, bias in biased for _, b in bias]
        scores.index_put_(
            at, torch.tensor(values, dtype=scores.dtype, device=device), accumulate=True
        )


def _is_plain_greedy(request: SampleRequest) -> bool:
    params = request.params
    return (
        params.is_greedy
        and not params.has_penalties
        and not params.shapes_logits
        and not params.bad_words_token_ids
        and params.logprobs is None
        and len(request.output_token_ids) >= params.min_tokens
        and request.matcher is None
    )


class Sampler:
    """Chooses one token per row of a step's logits.

    Holds only the shared generator (one per device, seeded with ``seed``) and the grammar
    bitmask buffer; never mutates the logits it is given, nor the matchers (the runner advances
    them with the chosen tokens).
    """

    def __init__(self, eos_token_ids: Iterable[int], seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._masker: Any = None  # structured.GrammarMasker, made on the first grammar row

    def __call__(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [num_requests={len(requests)}, vocab_size], "
                f"got shape {tuple(logits.shape)}"
            )
        logits = logits.float()
        if all(_is_plain_greedy(r) for r in requests):
            return SampleOutput(greedy_ids(logits).tolist(), [None] * len(requests))
        logits = self._apply_grammars(logits, requests)
        scores = self._apply_constraints(logits, requests)
        token_ids = self._choose(scores, requests)
        return SampleOutput(token_ids.tolist(), compute_logprobs(logits, token_ids, requests))

    def _apply_grammars(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest]
    ) -> torch.Tensor:
        """A copy of ``logits`` with every row's grammar mask applied; ``logits`` when none."""
        matchers = [r.matcher for r in requests]
        if all(m is None for m in matchers):
            return logits
        if self._masker is None:
            from kvrelay.engine.structured import GrammarMasker

            self._masker = GrammarMasker()
        masked = logits.clone()
        self._masker.apply(masked, matchers)
        return masked

    def _apply_constraints(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest]
    ) -> torch.Tensor:
        """allowed_token_ids, logit_bias, penalties, then min_tokens and bad-word masking
        (vLLM's order); returns ``logits`` itself when none applies."""
        shaped = [i for i, r in enumerate(requests) if r.params.shapes_logits]
        penalised = [i for i, r in enumerate(requests) if r.params.has_penalties]
        mask_rows, mask_ids = self._masked_ids(requests, logits.shape[1])
        if not shaped and not penalised and not mask_rows:
            return logits
        if not shaped and len(penalised) == len(requests):
            scores = apply_penalties(logits, requests)  # a new tensor
        else:
            scores = logits.clone()
            if shaped:
                shape_logits(scores, [(i, requests[i].params) for i in shaped])
            if penalised:
                rows = as_index(penalised, logits.device)
                scores[rows] = apply_penalties(scores[rows], [requests[i] for i in penalised])
        if mask_rows:
            index = (as_index(mask_rows, logits.device), as_index(mask_ids, logits.device))
            scores.index_put_(index, torch.tensor(-math.inf, device=logits.device))
        return scores

    def _masked_ids(
        self, requests: Sequence[SampleRequest], vocab_size: int
    ) -> tuple[list[int], list[int]]:
        """(row, token id) pairs to mask: eos and stop ids of rows still short of min_tokens,
        and the ids each row's bad words forbid next."""
        rows: list[int] = []
        token_ids: list[int] = []
        for row, request in enumerate(requests):
            params = request.params
            masked: Iterable[int] = ()
            if len(request.output_token_ids) < params.min_tokens:
                masked = {*self.eos_token_ids, *params.stop_token_ids}
            if params.bad_words_token_ids:
                masked = {*masked, *params.banned_ids(request.output_token_ids)}
            for token_id in masked:
                if token_id < vocab_size:
                    rows.append(row)
                    token_ids.append(token_id)
        return rows, token_ids

    def _choose(self, scores: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        token_ids = torch.empty(len(requests), dtype=torch.long, device=scores.device)
        greedy = [i for i, r in enumerate(requests) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(requests) if not r.params.is_greedy]

        def greedy_rows(part: torch.Tensor, _: Sequence[SampleRequest]) -> torch.Tensor:
            return greedy_ids(part)

        for group, choose in ((greedy, greedy_rows), (sampled, self._sample)):
            if not group:
                continue
            if len(group) == len(requests):
                return choose(scores, requests)
            rows = as_index(group, scores.device)
            token_ids[rows] = choose(scores[rows], [requests[i] for i in group])
        return token_ids

    def _sample(self, scores: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """Tempered, filtered and drawn: rows that filter draw among their candidates
        (``filter_candidates``) where those decide them, the rest over the vocabulary."""
        device = scores.device
        temperature = [r.params.temperature for r in requests]
        if any(t != 1 for t in temperature):
            scores = scores / as_column(temperature, device)
        uniform = self._uniforms([r.generator for r in requests], device)
        token_ids = torch.empty(len(requests), dtype=torch.long, device=device)
        whole = [i for i, r in enumerate(requests) if not r.params.has_filters]
        filtered = [i for i, r in enumerate(requests) if r.params.has_filters]
        if filtered:
            rows = as_index(filtered, device)
            part = scores if len(filtered) == len(requests) else scores[rows]
            params = [requests[i].params for i in filtered]
            keep = keep_counts([p.top_k for p in params], scores.shape[1])
            top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
            candidates, decided, rest = split_by_candidates(part, keep, top_p, min_p)
            if candidates is not None and decided:
                values, ids = candidates
                at = as_index(decided, device)
                positions = inverse_cdf(values[at].softmax(dim=-1), uniform[rows[at]])
                token_ids[rows[at]] = ids[at].gather(1, positions.unsqueeze(1)).squeeze(1)
            if rest:
                at = as_index(rest, device)
                kept = filter_whole(part[at], *pick(rest, keep, top_p, min_p))
                token_ids[rows[at]] = inverse_cdf(kept.softmax(dim=-1), uniform[rows[at]])
        if whole:
            rows = as_index(whole, device)
            part = scores if len(whole) == len(requests) else scores[rows]
            token_ids[rows] = inverse_cdf(part.softmax(dim=-1), uniform[rows])
        return token_ids

    def _uniforms(
        self, generators: Sequence[torch.Generator | None], device: torch.device
    ) -> torch.Tensor:
        """One uniform number in [0, 1) per row (float64): from the row's own generator, or
        for the rest from the sampler's shared one in one call."""
        uniform = torch.empty(len(generators), dtype=torch.float64, device=device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            return uniform.uniform_(generator=self._shared_generator(device))
        if shared:
            rows = as_index(shared, device)
            drawn = uniform.new_empty(len(shared))
            uniform[rows] = drawn.uniform_(generator=self._shared_generator(device))
        for row, generator in enumerate(generators):
            if generator is not None:
                uniform[row : row + 1].uniform_(generator=generator)
        return uniform

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator
