"""Scheduler policy with a fake runner: exact plans, preemption, abort, leak checks."""

from __future__ import annotations

import pytest

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.scheduler import Scheduler, StepPlan, StepResult
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.protocol.sampling_params import SamplingParams

BS = 4
EOS = 2


def make(num_blocks=16, max_tokens_step=64, max_seqs=8, max_len=128, policy="fcfs") -> Scheduler:
    bm = BlockManager(num_blocks, BS)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens_step,
        max_model_len=max_len,
        scheduling_policy=policy,
    )
    return Scheduler(cfg, bm, eos_token_ids=[EOS])


def add(s: Scheduler, seq_id: str, n: int, max_tokens: int = 4, first: int = 10, **kw) -> Sequence:
    """A sequence of prompt ``first, first + 1, ...``: the same default prompt for all, so
    sequences share prefix blocks unless a test gives them another ``first``."""
    seq = Sequence(
        seq_id, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **kw)
    )
    s.add(seq)
    return seq


def step(s: Scheduler, token: int = 7) -> tuple[StepPlan | None, list[Sequence]]:
    plan = s.schedule()
    if plan is None:
        return None, []
    tokens = [[token] if item.needs_sample else [] for item in plan.scheduled]
    finished = s.update(plan, StepResult(tokens, [[None] * len(t) for t in tokens]))
    return plan, finished


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(i.seq.seq_id, i.start, i.num_new_tokens) for i in plan.scheduled]


def test_requests_join_and_leave_every_step():
    s = make()
    add(s, "a", 5, max_tokens=2)
    plan, _ = step(s)
    assert shape(plan) == [("a", 0, 5)]
    add(s, "b", 3, max_tokens=3)
    plan, finished = step(s)
    assert shape(plan) == [("a", 5, 1), ("b", 0, 3)]
    assert [f.seq_id for f in finished] == ["a"]  # 2 tokens: done, leaves at once
    plan, _ = step(s)
    assert shape(plan) == [("b", 3, 1)]
    plan, finished = step(s)
    assert [f.seq_id for f in finished] == ["b"]
    assert not s.has_unfinished()
    s.block_manager.check_integrity()
    assert s.block_manager.num_leaked() == 0


def test_chunked_prefill_respects_the_token_budget():
    s = make(max_tokens_step=8)
    add(s, "long", 20, max_tokens=1)
    add(s, "short", 3, max_tokens=1)
    plans = []
    while s.has_unfinished():
        plan, _ = step(s)
        plans.append(shape(plan))
    assert plans == [
        [("long", 0, 8)],
        [("long", 8, 8)],
        [("long", 16, 4), ("short", 0, 3)],
    ]
    assert s.block_manager.num_leaked() == 0


def test_decodes_are_not_starved_by_a_long_prompt():
    s = make(max_tokens_step=6)
    add(s, "a", 2, max_tokens=10)
    step(s)
    add(s, "long", 20, max_tokens=1)
    plan, _ = step(s)
    assert shape(plan) == [("a", 2, 1), ("long", 0, 5)]


def test_max_num_seqs_caps_the_running_set():
    s = make(max_seqs=2)
    for name in "abc":
        add(s, name, 2)
    plan, _ = step(s)
    assert [i.seq.seq_id for i in plan.scheduled] == ["a", "b"]
    assert s.num_waiting == 1


def test_preemption_frees_the_newest_and_recomputes_it():
    s = make(num_blocks=4)  # 16 tokens of KV
    a = add(s, "a", 7, max_tokens=6)
    b = add(s, "b", 7, max_tokens=6, first=40)  # no block in common with a
    plan, _ = step(s)
    assert shape(plan) == [("a", 0, 7), ("b", 0, 7)]  # 2 blocks each: pool full
    plan, _ = step(s)  # a: 8 tokens fits its 2 blocks; b: 8 too
    assert shape(plan) == [("a", 7, 1), ("b", 7, 1)]
    plan, _ = step(s)  # a needs a 3rd block: b (newest) is preempted
    assert shape(plan) == [("a", 8, 1)]
    assert plan.preempted == ("b",)
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_preemptions == 1
    assert b.num_output_tokens == 2  # its output is kept and recomputed with the prompt
    while s.has_unfinished():
        step(s)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    s.block_manager.check_integrity()
    assert s.block_manager.num_leaked() == 0


def test_abort_frees_blocks_at_once():
    s = make()
    a = add(s, "a", 9, max_tokens=50)
    add(s, "w", 3)
    s.config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128)
    step(s)
    assert len(a.block_ids) == 3
    assert s.finish("a", SequenceStatus.FINISHED_ABORTED) is a
    assert a.block_ids == [] and a.finish_reason == "abort"
    assert s.finish("w", SequenceStatus.FINISHED_ABORTED) is not None  # waiting: removed
    assert s.finish("nope", SequenceStatus.FINISHED_ABORTED) is None
    assert not s.has_unfinished()
    assert s.block_manager.num_leaked() == 0
    s.block_manager.check_integrity()


def test_stop_conditions():
    s = make()
    eos = add(s, "eos", 3, max_tokens=10)
    step(s, token=EOS)
    assert eos.finish_reason == "stop"
    ign = add(s, "ign", 3, max_tokens=2, ignore_eos=True)
    step(s, token=EOS)
    step(s, token=EOS)
    assert ign.finish_reason == "length" and ign.num_output_tokens == 2
    st = add(s, "st", 3, max_tokens=10, stop_token_ids=[99])
    step(s, token=99)
    assert st.finish_reason == "stop" and st.stop_reason == 99
    mn = add(s, "mn", 3, max_tokens=10, min_tokens=2)
    step(s, token=EOS)
    assert not mn.is_finished
    step(s, token=EOS)
    assert mn.finish_reason == "stop"


def test_context_window_ends_a_sequence():
    s = make(max_len=6)
    seq = add(s, "a", 4, max_tokens=None)
    while s.has_unfinished():
        step(s)
    assert seq.num_tokens == 6 and seq.finish_reason == "length"


def test_duplicate_ids_are_rejected():
    s = make()
    add(s, "a", 2)
    with pytest.raises(ValueError, match="duplicate"):
        add(s, "a", 2)


def test_num_prefill_tokens_counts_prompt_work_left_less_the_cached_prefix():
    """What a worker reports as ``LoadReport.num_prefill_tokens`` (the router's queue)."""
    s = make(max_tokens_step=8)
    add(s, "long", 20)
    add(s, "short", 3)
    assert s.num_prefill_tokens() == 23  # both waiting, nothing cached
    step(s)  # long 0..8
    assert s.num_prefill_tokens() == 12 + 3
    step(s)  # long 8..16
    assert s.num_prefill_tokens() == 4 + 3
    step(s)  # long 16..20 and short 0..3: both decode now
    assert s.num_prefill_tokens() == 0
    # long's 5 full blocks are cached: a waiting prompt of its first 13 tokens computes only
    # its last one (3 cached blocks; the block holding the last token is never a hit)
    s.add(Sequence("again", list(range(10, 23)), SamplingParams(max_tokens=4)))
    assert s.num_prefill_tokens() == 1
    s.add(Sequence("other", list(range(50, 56)), SamplingParams(max_tokens=4)))  # no hit
    assert s.num_prefill_tokens() == 1 + 6
    while s.has_unfinished():
        step(s)
    assert s.num_prefill_tokens() == 0
    assert s.block_manager.num_leaked() == 0


# ---- the priority policy ---------------------------------------------------------------------


def test_priority_admits_the_most_urgent_first_then_by_arrival():
    s = make(max_seqs=1, policy="priority")
    for seq_id, priority in (("late", 5), ("urgent", -1), ("normal", 0), ("normal2", 0)):
        add(s, seq_id, 3, max_tokens=1, priority=priority)
    order = []
    while s.has_unfinished():
        plan, _ = step(s)
        order += [i.seq.seq_id for i in plan.scheduled]
    assert order == ["urgent", "normal", "normal2", "late"]
    fcfs = make(max_seqs=1)
    for seq_id in ("a", "b", "c"):
        add(fcfs, seq_id, 3, max_tokens=1, priority=9 if seq_id == "b" else 0)
    order = []
    while fcfs.has_unfinished():
        plan, _ = step(fcfs)
        order += [i.seq.seq_id for i in plan.scheduled]
    assert order == ["a", "b", "c"]  # fcfs reads no priority


def test_an_urgent_arrival_preempts_the_least_urgent_running_for_a_seat():
    s = make(max_seqs=2, policy="priority")
    low = add(s, "low", 3, max_tokens=8, priority=5)
    mid = add(s, "mid", 3, max_tokens=8, priority=1)
    step(s)
    step(s)
    urgent = add(s, "urgent", 3, max_tokens=2, priority=0)
    plan, _ = step(s)
    assert plan.preempted == ("low",)
    assert sorted(i.seq.seq_id for i in plan.scheduled) == ["mid", "urgent"]
    assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1
    equal = add(s, "equal", 3, max_tokens=2, priority=1)  # not more urgent than mid: waits
    plan, _ = step(s)
    assert plan.preempted == () and "equal" not in [i.seq.seq_id for i in plan.scheduled]
    while s.has_unfinished():
        step(s)
    assert [x.num_output_tokens for x in (low, mid, urgent, equal)] == [8, 8, 2, 2]
    s.block_manager.check_integrity()
    assert s.block_manager.num_leaked() == 0


def test_an_urgent_arrival_preempts_for_blocks_and_block_shortage_takes_the_least_urgent():
    s = make(num_blocks=4, policy="priority")  # 16 tokens of KV
    low = add(s, "low", 7, max_tokens=6, priority=3)
    high = add(s, "high", 7, max_tokens=6, priority=1, first=40)  # no block in common
    plan, _ = step(s)
    assert shape(plan) == [("high", 0, 7), ("low", 0, 7)]  # the most urgent first
    step(s)
    plan, _ = step(s)  # a 3rd block for either: the least urgent (low) goes, not the newest
    assert plan.preempted == ("low",) and shape(plan) == [("high", 8, 1)]
    urgent = add(s, "urgent", 6, max_tokens=1, priority=0)  # needs 2 blocks: 1 is free
    plan, _ = step(s)
    assert plan.preempted == ("high",)
    # urgent first; high comes back in the same step on its prefix-cached blocks
    assert shape(plan)[0] == ("urgent", 4, 2)  # its first block is low's prefix
    while s.has_unfinished():
        step(s)
    assert [x.num_output_tokens for x in (low, high, urgent)] == [6, 6, 1]
    s.block_manager.check_integrity()
    assert s.block_manager.num_leaked() == 0


def test_an_unknown_policy_is_refused():
    from kvrelay.cli.engine_args import SCHEDULING_POLICIES as CLI_POLICIES
    from kvrelay.engine.config import SCHEDULING_POLICIES, ConfigError

    assert CLI_POLICIES == SCHEDULING_POLICIES
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")


def test_a_burst_sharing_a_prefix_adopts_the_blocks_the_first_fills_in_the_same_step():
    """Three prompts of the same 10 tokens arrive together: the first computes them, the
    others adopt its two full blocks in the same step (its rows store their K/V before any
    attention reads it) and compute only the rest. A prompt that needs every token's
    logits adopts nothing; with a budget that cuts the first's chunk, only the blocks it
    fills in the step are adopted."""
    s = make()
    a, b, c = (add(s, name, 10) for name in "abc")
    d = add(s, "d", 10, prompt_logprobs=0)
    plan, _ = step(s)
    assert shape(plan) == [("a", 0, 10), ("b", 8, 2), ("c", 8, 2), ("d", 0, 10)]
    assert b.block_ids[:2] == a.block_ids[:2] == c.block_ids[:2]
    assert not set(d.block_ids) & set(a.block_ids)
    bm = s.block_manager
    assert bm.num_hit_tokens == 16 and b.num_cached_tokens == 8
    bm.check_integrity()
    while s.has_unfinished():
        step(s)
    assert bm.num_leaked() == 0
    s = make(max_tokens_step=12)
    first = add(s, "first", 10, first=50)
    add(s, "second", 10, first=50)
    plan, _ = step(s)  # first fills blocks 0-1 (8 tokens) and part of block 2
    assert shape(plan) == [("first", 0, 10), ("second", 8, 2)]
    s = make(max_tokens_step=6)
    add(s, "first", 10, first=50)
    add(s, "second", 10, first=50)
    plan, _ = step(s)  # first's 6 tokens fill one block, and spend the budget
    assert shape(plan) == [("first", 0, 6)]
    plan, _ = step(s)  # block 0 is cached now, block 1 fills in this step: both adopted
    assert shape(plan) == [("first", 6, 4), ("second", 8, 2)]
    assert first.block_ids[:2] == s.running[1].block_ids[:2]
