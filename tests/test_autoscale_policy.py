"""The scaling policy: exact decisions and reasons for given observations and times."""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.autoscale.policy import (
    InstanceLoad,
    Observation,
    Policy,
    PolicyConfig,
    RoleObservation,
    RoleTarget,
)

TARGET = RoleTarget(
    min_instances=1,
    max_instances=3,
    slo_ms=100.0,
    target_attainment=0.9,
    min_samples=4,
    max_queue_per_instance=2.0,
    max_kv_usage=0.8,
    scale_down_below=0.5,
    up_after=1,
    down_after=1,
    cooldown_up_s=10.0,
    cooldown_down_s=30.0,
)
CONFIG = PolicyConfig(
    prefill=dataclasses.replace(TARGET, slo_ms=500.0), decode=TARGET, fill_after_s=0.0
)


def inst(
    instance_id: str,
    queued: int = 0,
    running: int = 0,
    kv: float = 0.0,
    age: float = 100.0,
    removable: bool = True,
) -> InstanceLoad:
    return InstanceLoad(instance_id, queued, running, kv, age, removable)


def observe(
    prefill: tuple[InstanceLoad, ...] = (inst("p0", removable=False),),
    decode: tuple[InstanceLoad, ...] = (inst("d0", removable=False),),
    ttft: tuple[float, ...] = (),
    tpot: tuple[float, ...] = (),
) -> Observation:
    return Observation(RoleObservation(prefill, ttft), RoleObservation(decode, tpot))


def summary(policy: Policy, obs: Observation, now: float = 100.0, **kw):
    d = policy.decide(obs, now, **kw)
    return (d.current_prefill, d.prefill), (d.current_decode, d.decode), d.drain, list(d.reasons)


IDLE_2 = (inst("d0", removable=False), inst("decode-as0", age=5.0))

CASES = [
    (
        "low TPOT attainment adds a decode",
        observe(tpot=(50, 50, 150, 150)),
        (1, 1),
        (1, 2),
        (),
        ["decode 1->2: TPOT attainment 50% < 90% (SLO 100 ms, 4 requests)"],
    ),
    (
        "low TTFT attainment adds a prefill",
        observe(ttft=(100, 600, 700, 800, 900)),
        (1, 2),
        (1, 1),
        (),
        ["prefill 1->2: TTFT attainment 20% < 90% (SLO 500 ms, 5 requests)"],
    ),
    (
        "queue over the limit adds a decode",
        observe(decode=(inst("d0", queued=3, removable=False),)),
        (1, 1),
        (1, 2),
        (),
        ["decode 1->2: queue 3.0/instance > 2"],
    ),
    (
        "KV usage over the limit adds a decode",
        observe(decode=(inst("d0", kv=0.9, removable=False),)),
        (1, 1),
        (1, 2),
        (),
        ["decode 1->2: KV usage 90% > 80%"],
    ),
    (
        "every trigger is named",
        observe(decode=(inst("d0", queued=5, kv=0.95),), tpot=(200,) * 4),
        (1, 1),
        (1, 2),
        (),
        [
            "decode 1->2: TPOT attainment 0% < 90% (SLO 100 ms, 4 requests); "
            "queue 5.0/instance > 2; KV usage 95% > 80%"
        ],
    ),
    (
        "too few samples: attainment unknown, nothing moves",
        observe(tpot=(500, 500, 500)),
        (1, 1),
        (1, 1),
        (),
        [
            "prefill: steady at 1 (TTFT attainment unknown (0 requests), queue 0.0/instance,"
            " KV 0%)",
            "decode: steady at 1 (TPOT attainment unknown (3 requests), queue 0.0/instance, KV 0%)",
        ],
    ),
    (
        "at max: no scale-up",
        observe(decode=tuple(inst(f"d{i}", queued=4) for i in range(3))),
        (1, 1),
        (3, 3),
        (),
        [
            "prefill: steady at 1 (TTFT attainment unknown (0 requests), queue 0.0/instance,"
            " KV 0%)",
            "decode: at max 3 (queue 4.0/instance > 2)",
        ],
    ),
    (
        "idle: the newest removable decode is drained",
        observe(decode=IDLE_2, tpot=(10,) * 4),
        (1, 1),
        (2, 1),
        ("decode-as0",),
        [
            "decode 2->1: TPOT attainment 100% >= 90%; on 1: queue 0.0/instance <= 1,"
            " KV 0% <= 40%; draining decode-as0"
        ],
    ),
    (
        "the least loaded goes first, then the newest",
        observe(decode=(inst("a", running=1, age=1.0), inst("b", age=50.0), inst("c", age=20.0))),
        (1, 1),
        (3, 2),
        ("c",),
        [
            "decode 3->2: TPOT attainment unknown (0 requests); on 2: queue 0.0/instance <= 1,"
            " KV 0% <= 40%; draining c"
        ],
    ),
    (
        "the load would not fit on one instance fewer",
        observe(decode=(inst("d0", queued=1), inst("d1", queued=1))),
        (1, 1),
        (2, 2),
        (),
        [
            "prefill: steady at 1 (TTFT attainment unknown (0 requests), queue 0.0/instance,"
            " KV 0%)",
            "decode: steady at 2 (TPOT attainment unknown (0 requests), queue 1.0/instance, KV 0%)",
        ],
    ),
    (
        "no removable instance: nothing is drained",
        observe(decode=(inst("d0", removable=False), inst("d1", removable=False))),
        (1, 1),
        (2, 2),
        (),
        [
            "prefill: steady at 1 (TTFT attainment unknown (0 requests), queue 0.0/instance,"
            " KV 0%)",
            "decode: no removable instance (TPOT attainment unknown (0 requests); on 1:"
            " queue 0.0/instance <= 1, KV 0% <= 40%)",
        ],
    ),
    (
        "below min: clamped up at once",
        observe(decode=()),
        (1, 1),
        (0, 1),
        (),
        ["decode 0->1: below min 1 for 0.0s"],
    ),
    (
        "above max: clamped down, draining the least loaded",
        observe(decode=tuple(inst(f"d{i}", running=3 - i) for i in range(4))),
        (1, 1),
        (4, 3),
        ("d3",),
        ["decode 4->3: above max 3; draining d3"],
    ),
]


@pytest.mark.parametrize(
    "obs,prefill,decode,drain,reasons", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_one_evaluation(obs, prefill, decode, drain, reasons):
    assert summary(Policy(CONFIG), obs) == (prefill, decode, drain, reasons)


def test_prefill_and_decode_move_in_one_decision():
    obs = observe(prefill=(inst("p0", queued=3),), decode=(inst("d0", kv=0.9),), ttft=(1.0,) * 4)
    assert summary(Policy(CONFIG), obs) == (
        (1, 2),
        (1, 2),
        (),
        ["prefill 1->2: queue 3.0/instance > 2", "decode 1->2: KV usage 90% > 80%"],
    )


def test_hysteresis_needs_consecutive_evaluations():
    policy = Policy(dataclasses.replace(CONFIG, decode=dataclasses.replace(TARGET, up_after=3)))
    busy = observe(decode=(inst("d0", queued=3),))
    calm = observe()
    steps = [(busy, 1), (busy, 1), (calm, 1), (busy, 1), (busy, 1), (busy, 2)]
    for t, (obs, want) in enumerate(steps):
        assert policy.decide(obs, float(t)).decode == want, t
    # the held evaluations say how far the streak has got
    policy = Policy(dataclasses.replace(CONFIG, decode=dataclasses.replace(TARGET, up_after=3)))
    assert policy.decide(busy, 0.0).reasons[-1] == (
        "decode: over a limit 1/3 evaluations (queue 3.0/instance > 2)"
    )


def test_no_scale_up_within_cooldown():
    policy = Policy(CONFIG)
    busy1 = observe(decode=(inst("d0", queued=3),))
    busy2 = observe(decode=(inst("d0", queued=3), inst("decode-as0", queued=3)))
    assert policy.decide(busy1, 100.0).decode == 2
    held = policy.decide(busy2, 105.0)
    assert (held.decode, held.reasons[-1]) == (
        2,
        "decode: cooling down 5.0s before scaling up (queue 3.0/instance > 2)",
    )
    assert policy.decide(busy2, 110.0).decode == 3


def test_scale_down_waits_for_its_window_and_cooldown():
    target = dataclasses.replace(TARGET, down_after=3)
    policy = Policy(dataclasses.replace(CONFIG, decode=target))
    assert policy.decide(observe(decode=(inst("d0", queued=3),)), 0.0).decode == 2
    idle = observe(decode=IDLE_2)
    got = [policy.decide(idle, t) for t in (10.0, 20.0, 25.0, 29.0, 30.0)]
    assert [d.decode for d in got] == [2, 2, 2, 2, 1]
    assert got[0].reasons[-1].startswith("decode: under the low watermark 1/3 evaluations (")
    assert got[3].reasons[-1].startswith("decode: cooling down 1.0s before scaling down (")
    assert got[4].drain == ("decode-as0",)


def test_a_busy_evaluation_restarts_the_down_window():
    target = dataclasses.replace(TARGET, down_after=2, cooldown_down_s=0.0)
    policy = Policy(dataclasses.replace(CONFIG, decode=target))
    idle = observe(decode=IDLE_2)
    busy = observe(decode=(inst("d0", queued=1), inst("decode-as0", queued=1)))
    assert [policy.decide(o, 1.0).decode for o in (idle, busy, idle, idle)] == [2, 2, 2, 1]


def test_forced_counts_override_the_policy():
    policy = Policy(CONFIG)
    up = policy.decide(observe(), 0.0, forced={"decode": 3})
    assert (up.decode, up.forced, up.reasons) == (3, True, ("decode 1->3: forced by the operator",))
    held = policy.decide(observe(decode=IDLE_2), 1.0, forced={"decode": 2})
    assert (held.decode, held.is_change, held.forced) == (2, False, False)
    assert "decode: held at 2 by the operator" in held.reasons
    down = policy.decide(observe(decode=IDLE_2), 2.0, forced={"decode": 1})
    assert (down.decode, down.drain, down.forced) == (1, ("decode-as0",), True)
    assert down.reasons == ("decode 2->1: forced to 1 by the operator; draining decode-as0",)
    stuck = policy.decide(observe(decode=IDLE_2), 3.0, forced={"decode": 0})
    assert stuck.reasons == (
        "decode 2->1: forced to 0 by the operator (only 1 removable); draining decode-as0",
    )


def test_held_roles_do_not_move():
    policy = Policy(CONFIG)
    busy = observe(decode=(inst("d0", queued=9),))
    d = policy.decide(busy, 0.0, hold={"decode": "waiting for 1 instance(s) to join"})
    assert (d.decode, d.reasons[-1]) == (1, "decode: waiting for 1 instance(s) to join")
    assert policy.decide(busy, 1.0).decode == 2


def test_reconfigured_limits_apply_at_once():
    policy = Policy(CONFIG)
    policy.reconfigure(CONFIG.with_target("decode", min_instances=2))
    assert summary(policy, observe())[1:] == ((1, 2), (), ["decode 1->2: below min 2 for 0.0s"])


def test_a_role_below_min_is_filled_after_a_delay():
    policy = Policy(dataclasses.replace(CONFIG, fill_after_s=10.0))
    gone = observe(decode=())
    held = policy.decide(gone, 50.0)
    assert (held.decode, held.reasons[-1]) == (
        0,
        "decode: below min 1 for 0.0s (filling after 10s)",
    )
    assert policy.decide(observe(), 55.0).decode == 1  # it came back: the clock restarts
    assert policy.decide(gone, 56.0).decode == 0
    filled = policy.decide(gone, 66.0)
    assert (filled.decode, filled.reasons) == (1, ("decode 0->1: below min 1 for 10.0s",))


def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="min_instances <= max_instances"):
        RoleTarget(min_instances=3, max_instances=2)
    with pytest.raises(ValueError, match="target_attainment must be in"):
        RoleTarget(target_attainment=1.5)
    with pytest.raises(ValueError, match=r"unknown policy keys \['bogus'\]"):
        PolicyConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match=r"unknown decode policy keys \['slo'\]"):
        PolicyConfig.from_dict({"decode": {"slo": 1}})
    config = PolicyConfig.from_dict({"window_s": 5, "decode": {"up_after": 4}})
    assert (config.window_s, config.decode.up_after, config.prefill.up_after) == (5.0, 4, 2)
    assert config.with_target("decode", max_instances=None) == config
