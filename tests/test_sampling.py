from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvrelay.engine.sampling import (
    Sampler,
    SampleRequest,
    apply_penalties,
    create_generator,
    inverse_cdf,
)
from kvrelay.engine.sampling_filters import (
    _filter_nucleus,
    _filter_sorted,
    filter_candidates,
    filter_logits,
    filter_whole,
    keep_counts,
)
from kvrelay.protocol.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
EOS = 2


def request(
    params: SamplingParams,
    output: tuple[int, ...] = (),
    prompt: tuple[int, ...] = (0,),
    generator: torch.Generator | None = None,
) -> SampleRequest:
    return SampleRequest(params, prompt, output, generator)


def random_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3


# --- SamplingParams validation ---------------------------------------------------------------

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [str(i) for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID)
def test_invalid_values_name_field_and_value(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be") as info:
        SamplingParams(**kwargs)
    assert "got " in str(info.value)


def test_offending_value_is_in_message() -> None:
    with pytest.raises(ValueError, match=r"got 1\.5$"):
        SamplingParams(top_p=1.5)


def test_boundary_values_are_valid() -> None:
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        seed=-(2**63),
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.5,
        max_tokens=None,
        min_tokens=1000,
        logprobs=MAX_LOGPROBS,
        stop=[str(i) for i in range(MAX_STOP_STRINGS)],
    )
    SamplingParams(max_tokens=1, min_tokens=1, logprobs=0, seed=2**64 - 1)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("END", ("END",)), (["a", "b"], ("a", "b")), (("c",), ("c",))],
)
def test_stop_is_normalised_to_tuple(stop: Any, expected: tuple[str, ...]) -> None:
    params = SamplingParams(stop=stop)
    assert params.stop == expected
    hash(params)


@pytest.mark.parametrize(
    ("ids", "expected"), [(None, ()), (7, (7,)), ([1, 2], (1, 2)), (range(3), (0, 1, 2))]
)
def test_stop_token_ids_are_normalised_to_tuple(ids: Any, expected: tuple[int, ...]) -> None:
    assert SamplingParams(stop_token_ids=ids).stop_token_ids == expected


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy


def test_create_generator() -> None:
    assert create_generator(SamplingParams()) is None
    first = create_generator(SamplingParams(seed=5))
    second = create_generator(SamplingParams(seed=5))
    assert first is not None and second is not None
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=second))


# --- greedy and filters ------------------------------------------------------------------------


def test_greedy_is_argmax_and_lowest_id_on_ties() -> None:
    logits = random_logits(5, 11, seed=0)
    logits[4] = torch.tensor([0.0, 3.0, 1.0, 3.0] + [0.0] * 7)
    before = logits.clone()
    out = Sampler([EOS])(logits, [request(GREEDY)] * 5)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[4] == 1
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


def test_greedy_takes_the_first_maximum_of_a_wide_row() -> None:
    """Ties far apart in a real vocabulary's width (the vectorized max must still report
    the first)."""
    logits = random_logits(4, 49152, seed=3)
    for row, ids in enumerate([(7, 40000), (31000, 31001, 49151), (0, 49151), (16, 17, 18)]):
        logits[row, list(ids)] = 50.0
    out = Sampler([EOS])(logits, [request(GREEDY)] * 4)
    assert out.token_ids == [7, 31000, 0, 16]


def test_greedy_casts_half_logits() -> None:
    logits = random_logits(3, 9, seed=1).half()
    out = Sampler([EOS])(logits, [request(GREEDY, output=(1,))] * 3)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_empty_batch() -> None:
    assert Sampler([EOS])(torch.zeros(0, 8), []).token_ids == []


def test_logits_shape_must_match_requests() -> None:
    with pytest.raises(ValueError, match="num_requests=2"):
        Sampler([EOS])(torch.zeros(3, 8), [request(GREEDY)] * 2)


def test_top_k_one_equals_greedy_at_temperature_one() -> None:
    logits = random_logits(64, 50, seed=2)
    logits[0, :3] = 100.0  # a three-way tie: top_k=1 keeps the lowest id
    out = Sampler([EOS])(logits, [request(SamplingParams(top_k=1))] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == 0


def test_tiny_top_p_picks_argmax() -> None:
    logits = random_logits(64, 50, seed=3)
    params = SamplingParams(temperature=1.5, top_p=1e-6)
    out = Sampler([EOS])(logits, [request(params)] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_filter_logits_exact_masks() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 4)
    logits = probs.log()
    kept = filter_logits(
        logits, top_k=[2, 0, 0, -1], top_p=[1.0, 0.65, 0.75, 1.0], min_p=[0.0, 0.0, 0.0, 0.6]
    )
    masks = torch.isfinite(kept).tolist()
    assert masks[0] == [False, True, False, True]  # top-2: 0.4, 0.3
    assert masks[1] == [False, True, False, True]  # 0.4 + 0.3 >= 0.65
    assert masks[2] == [False, True, True, True]  # 0.4 + 0.3 < 0.75, so 0.2 stays
    assert masks[3] == [False, True, False, True]  # p >= 0.6 * 0.4
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])


def test_top_p_applies_after_top_k() -> None:
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()
    kept = filter_logits(logits, top_k=[2], top_p=[0.55], min_p=[0.0])
    # renormalised over {1, 3}: 4/7 >= 0.55, so only token 1 is left
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]


def test_min_p_never_draws_dropped_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2000, 4)
    out = Sampler([EOS], seed=4)(logits, [request(SamplingParams(min_p=0.2))] * 2000)
    assert set(out.token_ids) == {0, 1, 2}


def _wide_logits(num_rows: int, vocab_size: int, seed: int, scale: float) -> torch.Tensor:
    """Logits of a trained model's spread, rounded to a grid so that many tie."""
    return (random_logits(num_rows, vocab_size, seed) * scale / 3).mul(4).round().div(4)


FILTERS = [  # (top_k, top_p, min_p): every filter alone and together, tight and loose
    (50, 1.0, 0.0), (1, 1.0, 0.0), (300, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.99, 0.0),
    (0, 1.0, 0.05), (0, 1.0, 0.3), (40, 0.8, 0.0), (200, 0.95, 0.1), (1000, 0.9, 0.0),
]  # fmt: skip


@pytest.mark.parametrize("scale", [1.0, 4.0, 8.0])
def test_candidate_filters_equal_the_full_sort(scale: float) -> None:
    """``filter_logits`` ranks a wide row's largest logits only; rows those decide get the
    same kept set as the whole row's stable sort (ties at the candidates' edge included), the
    rest fall back to that sort."""
    vocab_size = 5000
    logits = _wide_logits(len(FILTERS) * 3, vocab_size, seed=int(scale), scale=scale)
    rows = FILTERS * 3
    top_k, top_p, min_p = ([row[i] for row in rows] for i in range(3))
    keep = keep_counts(top_k, vocab_size)
    expected = _filter_sorted(logits, keep, top_p, min_p)
    candidates = filter_candidates(logits, keep, top_p, min_p)
    assert candidates is not None
    _, _, decided = candidates
    assert torch.equal(torch.isfinite(filter_logits(logits, top_k, top_p, min_p)),
                       torch.isfinite(expected))  # fmt: skip
    # whole rows: min-p alone as a threshold, without the sort
    assert torch.equal(torch.isfinite(filter_whole(logits, keep, top_p, min_p)),
                       torch.isfinite(expected))  # fmt: skip
    if scale == 8.0:  # a peaked spread: the candidates decide every row
        assert bool(decided.all())
    if scale == 1.0:  # a flat one: top-p 0.99 keeps most of the vocabulary
        assert not bool(decided.all())


NUCLEUS = [(0.05, 0.0), (0.5, 0.0), (0.9, 0.0), (0.99, 0.0), (0.999, 0.0), (0.9, 0.02)]


@pytest.mark.parametrize("scale", [0.25, 1.0, 4.0])
def test_nucleus_bins_equal_the_full_sort(scale: float) -> None:
    """Top-p without a top-k finds its edge by value bins and ranks only the edge bin's
    tokens (``_filter_nucleus``): the same logits, dropped at the same places, as the whole
    row's stable sort, on spreads from flat to peaked, with many ties (a grid of 0.25) and
    a grammar's mask."""
    vocab_size = 5000
    logits = _wide_logits(len(NUCLEUS) * 4, vocab_size, seed=int(scale * 4), scale=scale)
    logits[::4, 1000:] = -math.inf  # masked: a fifth of the vocabulary left finite
    top_p, min_p = ([row[i] for row in NUCLEUS * 4] for i in range(2))
    keep = [vocab_size] * len(top_p)
    expected = _filter_sorted(logits, keep, top_p, min_p)
    assert torch.equal(_filter_nucleus(logits, keep, top_p, min_p), expected)
    assert torch.equal(filter_logits(logits, [0] * len(top_p), top_p, min_p), expected)
    kept = torch.isfinite(expected).sum(dim=-1)
    assert int(kept.min()) >= 1 and int(kept.max()) > 100  # an edge among many tokens


def test_nucleus_edge_inside_a_run_of_equal_logits_keeps_the_lowest_ids() -> None:
    """Top-p's edge falls inside runs of equal logits: the run's lowest ids are kept. Rows:
    all equal (every token in the first bin), two levels, one finite token. Each p lies
    half a token's mass past a token's edge, clear of float32's rounding."""
    vocab_size = 4096
    logits = torch.zeros(3, vocab_size)
    logits[1, 1024:3072] = math.log(3.0)  # 2,048 tokens of 3/8192 each, 2,048 of 1/8192
    logits[2, :] = -math.inf
    logits[2, 7] = 1.0
    top_p, keep = [0.5 + 0.5 / 4096, 0.875 + 0.5 / 8192, 0.3], [vocab_size] * 3
    kept = torch.isfinite(_filter_nucleus(logits, keep, top_p, [0.0] * 3))
    assert kept[0].nonzero().flatten().tolist() == list(range(2049))
    # the first run (ids 1024-3071) holds 0.75 of the mass; the second's lowest ids come
    # next: 1,024 tokens (0-1023) make 0.125 more, and 3072's mass before is 0.875 exactly
    assert kept[1].nonzero().flatten().tolist() == list(range(3073))
    assert kept[2].nonzero().flatten().tolist() == [7]
    assert torch.equal(kept, torch.isfinite(_filter_sorted(logits, keep, top_p, [0.0] * 3)))


def test_flat_top_p_rows_are_not_sorted_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat row under top-p 0.9 keeps most of the vocabulary, so its candidates do not
    decide it; it takes the value bins, not a sort of the whole row."""
    logits = _wide_logits(4, 5000, seed=3, scale=0.5)
    top_p = [0.9] * 4
    expected = _filter_sorted(logits, [5000] * 4, top_p, [0.0] * 4)
    candidates = filter_candidates(logits, [5000] * 4, top_p, [0.0] * 4)
    assert candidates is not None and not bool(candidates[2].any())

    def no_sort(*_: Any) -> torch.Tensor:
        raise AssertionError("sorted a whole row")

    monkeypatch.setattr("kvrelay.engine.sampling_filters._filter_sorted", no_sort)
    assert torch.equal(filter_logits(logits, [0] * 4, top_p, [0.0] * 4), expected)


def test_masked_rows_are_decided_by_their_candidates() -> None:
    """A grammar leaves a few tokens finite: a loose top-p over them decides the row among
    the candidates (no whole-row sort), with the full sort's kept set."""
    vocab_size = 5000
    logits = torch.full((2, vocab_size), -math.inf)
    logits[:, 100:110] = torch.arange(10.0) / 4
    keep, top_p, min_p = [vocab_size, 20], [0.99, 1.0], [0.0, 0.0]
    candidates = filter_candidates(logits, keep, top_p, min_p)
    assert candidates is not None and bool(candidates[2].all())
    expected = _filter_sorted(logits, keep, top_p, min_p)
    assert torch.equal(filter_logits(logits, [0, 20], top_p, min_p), expected)


def test_candidate_ties_at_the_edge_keep_the_lowest_ids() -> None:
    """A top-k boundary inside a run of equal logits keeps the lowest ids of the run, also
    when the run reaches past the candidates (the row then sorts whole)."""
    vocab_size = 4096
    logits = torch.zeros(2, vocab_size)
    logits[:, 4000:] = 5.0  # 96 equal leaders, the highest ids
    logits[0, 10:600] = 1.0  # 590 tied runners-up: top-k 100 keeps the 4 lowest of them
    kept = torch.isfinite(filter_logits(logits, [100, 100], [1.0, 1.0], [0.0, 0.0]))
    assert kept[0].nonzero().flatten().tolist() == [10, 11, 12, 13, *range(4000, 4096)]
    assert kept[1].nonzero().flatten().tolist() == [0, 1, 2, 3, *range(4000, 4096)]


@pytest.mark.parametrize("vocab_size", [40, 4096, 4100])
def test_inverse_cdf_never_picks_a_zero_probability_token(vocab_size: int) -> None:
    """At the ends of [0, 1) too: u = 0 gives the first token with mass, u just below 1
    the last (two searches for a wide row: its block, then the token)."""
    probs = torch.zeros(3, vocab_size)
    tokens = [5, vocab_size // 2 + 3, vocab_size - 7]
    probs[:, tokens] = torch.tensor([0.2, 0.5, 0.3])
    uniform = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf(probs, uniform).tolist() == tokens


def test_inverse_cdf_wide_rows_follow_the_distribution() -> None:
    """The two searches of a wide row (block, then token) draw each token with its
    probability: tokens in different blocks, in one block, at a block's edges."""
    vocab_size = 128 * 64
    chosen = [0, 127, 128, 129, 4000, 4001, vocab_size - 1]
    probs = torch.tensor([0.05, 0.1, 0.2, 0.05, 0.3, 0.1, 0.2])
    row = torch.zeros(vocab_size)
    row[chosen] = probs
    uniform = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    drawn = inverse_cdf(row.expand(20000, vocab_size), uniform)
    assert set(drawn.tolist()) <= set(chosen)
    position = {token: i for i, token in enumerate(chosen)}
    # 6 degrees of freedom: 22.46 is the 99.9% quantile; fixed seed, so deterministic
    assert chi_square([position[t] for t in drawn.tolist()], probs) < 22.46


def test_top_k_over_a_wide_vocabulary_follows_the_distribution() -> None:
    """Sampling among the candidates: top-k 3 of a 49,152-token row draws its three
    largest with their renormalised probabilities, and nothing else."""
    vocab_size = 49152
    logits = torch.full((4000, vocab_size), -5.0)
    logits[:, [7, 30000, 49151]] = torch.tensor([0.2, 0.5, 0.3]).log()
    logits[:, 8] = math.log(0.1) - 1.0  # fourth: dropped by top-k 3
    out = Sampler([EOS], seed=5)(logits, [request(SamplingParams(top_k=3))] * 4000)
    assert set(out.token_ids) <= {7, 30000, 49151}
    position = {7: 0, 30000: 1, 49151: 2}
    assert chi_square([position[t] for t in out.token_ids], torch.tensor([0.2, 0.5, 0.3])) < 16.27


# --- distributions and seeds ---------------------------------------------------------------------


def chi_square(token_ids: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(token_ids), minlength=len(probs)).double()
    expected = probs.double() * len(token_ids)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_gives_expected_distribution(temperature: float) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(20000, 4)
    params = SamplingParams(temperature=temperature)
    out = Sampler([9], seed=123)(logits, [request(params)] * 20000)
    tempered = probs ** (1 / temperature)
    # 3 degrees of freedom: 16.27 is the 99.9% quantile; fixed seed, so this is deterministic
    assert chi_square(out.token_ids, tempered / tempered.sum()) < 16.27


def test_seeded_request_draws_from_its_own_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    sampler = Sampler([9])
    params = SamplingParams(seed=77)
    generator = create_generator(params)
    rows = [request(params, generator=generator)]
    token_ids = [sampler(probs.log()[None], rows).token_ids[0] for _ in range(4000)]
    assert chi_square(token_ids, probs) < 16.27


def run_steps(
    params: SamplingParams, layout: str, num_steps: int = 12, vocab_size: int = 40
) -> list[int]:
    """Decodes ``num_steps`` tokens for ``params``, placed among other rows as ``layout`` says.

    The target row always sees the same logits; the other rows differ per layout.
    """
    generator = create_generator(params)
    others = {
        "alone": [],
        "first": [SamplingParams(), GREEDY, SamplingParams(seed=9, top_k=5)],
        "middle": [SamplingParams(top_p=0.8), SamplingParams(seed=3)],
        "last": [SamplingParams(temperature=0.7), SamplingParams(seed=1, min_p=0.1), GREEDY],
    }[layout]
    position = {"alone": 0, "first": 0, "middle": 1, "last": len(others)}[layout]
    sampler = Sampler([EOS], seed=len(others))
    other_generators = [create_generator(p) for p in others]
    output: list[int] = []
    for step in range(num_steps):
        target_logits = random_logits(1, vocab_size, seed=step)
        other_logits = random_logits(len(others), vocab_size, seed=1000 + step)
        rows = [request(p, generator=g) for p, g in zip(others, other_generators)]
        rows.insert(position, request(params, output=tuple(output), generator=generator))
        logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
        output.append(sampler(logits, rows).token_ids[position])
    return output


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=42),
        SamplingParams(seed=42, temperature=0.8, top_k=10, top_p=0.9),
        SamplingParams(seed=7, min_p=0.05, presence_penalty=0.5, logprobs=2),
    ],
)
def test_seeded_tokens_do_not_depend_on_batch(params: SamplingParams) -> None:
    expected = run_steps(params, "alone")
    assert len(set(expected)) > 3  # it really samples
    for layout in ("first", "middle", "last"):
        assert run_steps(params, layout) == expected, layout


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=42, temperature=2.0),
        SamplingParams(seed=42, top_k=20),
        SamplingParams(seed=5, top_p=0.5, temperature=3.0),  # the candidates decide it
        SamplingParams(seed=5, top_p=0.99),  # a flat row: the value bins
        SamplingParams(seed=9, min_p=0.01, temperature=2.0),
    ],
)
def test_seeded_tokens_do_not_depend_on_batch_over_a_wide_vocabulary(
    params: SamplingParams,
) -> None:
    """As above on 5,000 tokens, where rows draw among their candidates or over the whole
    row (``filter_candidates``) beside others that take the other way."""
    expected = run_steps(params, "alone", vocab_size=5000)
    assert len(set(expected)) > 3
    for layout in ("first", "middle", "last"):
        assert run_steps(params, layout, vocab_size=5000) == expected, layout


def test_different_seeds_give_different_sequences() -> None:
    sequences = {tuple(run_steps(SamplingParams(seed=seed), "alone")) for seed in range(5)}
    assert len(sequences) == 5


def test_shared_generator_is_seeded_by_sampler() -> None:
    logits = random_logits(8, 30, seed=5)
    rows = [request(SamplingParams())] * 8
    first = [Sampler([EOS], seed=11)(logits, rows).token_ids for _ in range(2)]
    second = [Sampler([EOS], seed=11)(logits, rows).token_ids for _ in range(2)]
    assert first == second


# --- penalties and min_tokens ---------------------------------------------------------------------


def test_penalties_exact_arithmetic() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0], [2.0, -1.0, 0.5, 3.0, -4.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        request(params, prompt=(0, 0, 4), output=(1, 1, 2)),
        request(SamplingParams(frequency_penalty=-1.0), prompt=(0,), output=(3, 3, 3)),
    ]
    penalised = apply_penalties(logits, rows)
    # row 0: 0 in prompt: 2/2; 1 twice in output: -1*2 - 2*0.5 - 0.25; 2 once: 0.5/2 - 0.5 - 0.25;
    #        3 unseen; 4 in prompt: -4*2
    # row 1: no repetition penalty; 3 three times with frequency -1: 3 + 3
    assert penalised.tolist() == [[1.0, -3.25, -0.5, 3.0, -8.0], [2.0, -1.0, 0.5, 6.0, -4.0]]
    assert logits[0, 0] == 2.0  # input untouched


def _dense_penalties(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """The penalties by [M, V] counts and masks: the definition ``apply_penalties`` keeps."""
    vocab_size = logits.shape[1]

    def counts(ids_per_row: list[Any]) -> torch.Tensor:
        out = torch.zeros(len(ids_per_row), vocab_size)
        for row, ids in enumerate(ids_per_row):
            for t in ids:
                if t < vocab_size:
                    out[row, t] += 1
        return out

    output = counts([r.output_token_ids for r in requests])
    factor = torch.tensor([[r.params.repetition_penalty] for r in requests])
    prompt = counts([r.prompt_token_ids for r in requests])
    seen = ((prompt > 0) | (output > 0)) & (factor != 1)
    scaled = torch.where(logits > 0, logits / factor, logits * factor)
    logits = torch.where(seen, scaled, logits)
    frequency = torch.tensor([[r.params.frequency_penalty] for r in requests])
    presence = torch.tensor([[r.params.presence_penalty] for r in requests])
    return logits - frequency * output - presence * (output > 0).float()


def test_penalties_touch_only_seen_tokens_and_equal_dense_counts() -> None:
    """Rows with and without each penalty, repeated ids, ids past the vocabulary, an empty
    output: bit for bit the dense definition."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, generator=gen) * 3
    ids = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (40, 0, 25, 60, 7)]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.7),
        SamplingParams(presence_penalty=1.5, repetition_penalty=1.1),
        SamplingParams(),
    ]
    rows = [request(p, output=tuple(o), prompt=(1, 2, 2, 299, 305)) for p, o in zip(params, ids)]
    assert torch.equal(apply_penalties(logits, rows), _dense_penalties(logits, rows))


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.0]])
    rows = [request(SamplingParams(repetition_penalty=0.5), prompt=(0, 1, 2))]
    assert apply_penalties(logits, rows).tolist() == [[4.0, -0.5, 0.0]]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0, presence_penalty=1.0),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        GREEDY,
    ]
    rows = [request(p, prompt=(1,), output=(1,)) for p in params]
    assert Sampler([EOS])(logits, rows).token_ids == [2, 2, 1]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos: bool) -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0, 2.0]])
    params = SamplingParams(
        temperature=0, min_tokens=3, stop_token_ids=[3, 40], ignore_eos=ignore_eos
    )
    sampler = Sampler([EOS, 4])
    assert sampler(logits, [request(params, output=(1, 1))]).token_ids == [5]
    assert sampler(logits, [request(params, output=(1, 1, 1))]).token_ids == [EOS]


def test_min_tokens_applies_to_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 5.0]]).expand(500, 4)
    params = SamplingParams(min_tokens=1, stop_token_ids=[3])
    out = Sampler([EOS], seed=0)(logits, [request(params)] * 500)
    assert set(out.token_ids) == {0, 1}


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranked_top_k() -> None:
    logits = random_logits(4, 25, seed=6)
    rows = [
        request(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.3), output=(1,)),
        request(SamplingParams(temperature=0.6, logprobs=0, seed=2)),
        request(SamplingParams(temperature=2.0, logprobs=MAX_LOGPROBS, top_k=8)),
        request(SamplingParams(temperature=0.9)),
    ]
    out = Sampler([EOS], seed=1)(logits, rows)
    expected = logits.log_softmax(dim=-1)
    assert out.logprobs[3] is None
    for row, k in [(0, 3), (1, 0), (2, MAX_LOGPROBS)]:
        entry = out.logprobs[row]
        assert entry is not None
        token_id = out.token_ids[row]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(expected[row, token_id].item(), abs=1e-6)
        assert entry.rank == int((expected[row] > expected[row, token_id]).sum()) + 1
        top_values, top_ids = expected[row].topk(k)
        assert [token for token, _ in entry.top] == top_ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert out.logprobs[1] is not None and out.logprobs[1].top == ()


def test_greedy_logprob_rank_is_one() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = Sampler([EOS])(logits, [request(SamplingParams(temperature=0, logprobs=1))])
    entry = out.logprobs[0]
    assert entry is not None
    assert (entry.token_id, entry.rank) == (1, 1)
    assert entry.top == ((1, pytest.approx(entry.logprob)),)
    assert entry.logprob == pytest.approx(2.0 - math.log(1 + math.e**2 + math.e), abs=1e-6)
