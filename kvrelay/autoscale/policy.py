"""The scaling policy: observed load and SLO attainment in, a ``ScaleDecision`` out.

Pure Python (no torch, no I/O, no clock): the autoscaler passes the time in, so tests give
exact expectations. Prefill and decode are judged separately, each against its own
``RoleTarget``; one evaluation moves a role by at most one instance, except to come back
inside ``[min_instances, max_instances]`` or to reach an operator's forced count::

    per role, every evaluation
      forced count set             -> go to it (drain the least loaded removable ones)
      held (joining, disabled)     -> no change; streaks start again
      n < min for fill_after_s     -> up to min at once (no hysteresis, no cooldown)
      n > max                      -> down to max at once
      up trigger (any of)          attainment < target | queue/instance > max | KV > max
          up_after in a row, n < max, cooldown_up_s since the last change   -> n + 1
      down condition (all of)      attainment >= target (or too few samples) and the load
                                   spread over n - 1 instances stays under scale_down_below
                                   of both limits
          down_after in a row, n > min, cooldown_down_s since the last change -> n - 1,
          draining the least loaded removable instance (the newest among equals)

Attainment is the fraction of the window's finished requests whose TTFT (prefill) or mean
TPOT (decode) met the SLO; with fewer than ``min_samples`` it is unknown and neither
triggers a scale-up nor blocks a scale-down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from kvrelay.autoscale.base import ScaleDecision

ScaledRole = Literal["prefill", "decode"]
ROLES: tuple[ScaledRole, ...] = ("prefill", "decode")
SLO_METRIC = {"prefill": "TTFT", "decode": "TPOT"}


@dataclasses.dataclass(frozen=True, slots=True)
class RoleTarget:
    """What one role should meet, and how eagerly the policy moves it."""

    min_instances: int = 1  # never fewer
    max_instances: int = 4  # never more
    slo_ms: float = 1000.0  # TTFT (prefill) or mean TPOT (decode) a request should meet
    target_attainment: float = 0.9  # fraction of the window's requests meeting slo_ms
    min_samples: int = 10  # fewer finished requests in the window: attainment unknown
    max_queue_per_instance: float = 4.0  # mean queued requests per instance that scale up
    max_kv_usage: float = 0.85  # mean KV usage (0-1) that scales up
    scale_down_below: float = 0.3  # low watermark, as a fraction of both limits above
    up_after: int = 2  # consecutive evaluations over a limit before scaling up
    down_after: int = 5  # consecutive evaluations under the low watermark before scaling down
    cooldown_up_s: float = 15.0  # seconds after the role's last change before scaling up
    cooldown_down_s: float = 60.0  # seconds after the role's last change before scaling down

    def __post_init__(self) -> None:
        if not 0 <= self.min_instances <= self.max_instances:
            raise ValueError(
                f"need 0 <= min_instances <= max_instances, got "
                f"{self.min_instances} and {self.max_instances}"
            )
        for name in ("slo_ms", "max_queue_per_instance"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("target_attainment", "max_kv_usage", "scale_down_below"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("min_samples", "up_after", "down_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("cooldown_up_s", "cooldown_down_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def _default_prefill() -> RoleTarget:
    return RoleTarget(slo_ms=1000.0)


def _default_decode() -> RoleTarget:
    return RoleTarget(slo_ms=100.0)


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyConfig:
    prefill: RoleTarget = dataclasses.field(default_factory=_default_prefill)  # TTFT SLO
    decode: RoleTarget = dataclasses.field(default_factory=_default_decode)  # TPOT SLO
    window_s: float = 30.0  # SLO attainment over the requests finished this long ago or less
    fill_after_s: float = 10.0  # a role below min (instances died) waits this long to be filled

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.fill_after_s < 0:
            raise ValueError(f"fill_after_s must be >= 0, got {self.fill_after_s}")

    def target(self, role: ScaledRole) -> RoleTarget:
        return self.prefill if role == "prefill" else self.decode

    def with_target(self, role: ScaledRole, **changes: Any) -> PolicyConfig:
        """A copy with ``changes`` applied to one role's target (validated); None: unchanged."""
        changes = {k: v for k, v in changes.items() if v is not None}
        target = dataclasses.replace(self.target(role), **changes)
        if role == "prefill":
            return dataclasses.replace(self, prefill=target)
        return dataclasses.replace(self, decode=target)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyConfig:
        """``{"window_s": 10, "decode": {"max_queue_per_instance": 2, ...}, "prefill": {...}}``.

        Raises:
            ValueError: an unknown key or a bad value, named.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown policy keys {sorted(unknown)}; valid: {sorted(known)}")
        config = cls(**_typed(cls(), {k: v for k, v in data.items() if k not in ROLES}, "policy"))
        for role in ROLES:
            changes = data.get(role, {})
            if not isinstance(changes, Mapping):
                raise ValueError(f"policy {role!r} must be an object, got {changes!r}")
            fields = {f.name for f in dataclasses.fields(RoleTarget)}
            bad = set(changes) - fields
            if bad:
                raise ValueError(
                    f"unknown {role} policy keys {sorted(bad)}; valid: {sorted(fields)}"
                )
            config = config.with_target(role, **_typed(config.target(role), changes, role))
        return config


def _typed(defaults: object, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` as the types of ``defaults``' fields (JSON gives 5 for 5.0); ValueError else."""
    out = {}
    for name, value in values.items():
        want = type(getattr(defaults, name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} {name} must be a number, got {value!r}")
        if want is int and not isinstance(value, int):
            raise ValueError(f"{where} {name} must be an integer, got {value!r}")
        out[name] = want(value)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One live (not draining) instance as the policy sees it."""

    instance_id: str
    num_queued: int  # waiting for the engine or for KV room (decode: + pending hand-offs)
    num_running: int
    kv_usage: float  # 0-1
    age_s: float = 0.0  # seconds since it joined; the newest goes first among equals
    is_removable: bool = True  # the hook can remove this one (local: it started it)


@dataclasses.dataclass(frozen=True, slots=True)
class RoleObservation:
    instances: tuple[InstanceLoad, ...] = ()
    latencies_ms: tuple[float, ...] = ()  # the window's TTFTs (prefill) or mean TPOTs (decode)


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    prefill: RoleObservation = RoleObservation()
    decode: RoleObservation = RoleObservation()
    request_rate: float = 0.0  # finished requests per second over the window

    def role(self, role: ScaledRole) -> RoleObservation:
        return self.prefill if role == "prefill" else self.decode


class Signals(NamedTuple):
    """What the policy reads from one role's observation."""

    num_instances: int
    attainment: float | None  # None: fewer than min_samples in the window
    num_samples: int
    queue_per_instance: float  # mean; 0 with no instance
    kv_usage: float  # mean; 0 with no instance


def signals(target: RoleTarget, obs: RoleObservation) -> Signals:
    n = len(obs.instances)
    samples = obs.latencies_ms
    attainment = None
    if len(samples) >= target.min_samples:
        attainment = sum(1 for x in samples if x <= target.slo_ms) / len(samples)
    queue = sum(i.num_queued for i in obs.instances) / n if n else 0.0
    kv = sum(i.kv_usage for i in obs.instances) / n if n else 0.0
    return Signals(n, attainment, len(samples), queue, kv)


class _Verdict(NamedTuple):
    desired: int
    drain: tuple[str, ...]
    reasons: tuple[str, ...]
    is_change: bool
    is_forced: bool = False


@dataclasses.dataclass(slots=True)
class _RoleState:
    up_streak: int = 0  # consecutive evaluations with an up trigger
    down_streak: int = 0  # consecutive evaluations under the low watermark
    last_change: float | None = None  # ``now`` of the role's last change
    below_min_since: float | None = None  # ``now`` when the role fell below min


class Policy:
    """Stateful across evaluations: hysteresis streaks and the time of each role's last change.

    ``decide`` is the only method that changes that state; call it once per evaluation.
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._state = {role: _RoleState() for role in ROLES}

    def reconfigure(self, config: PolicyConfig) -> None:
        """New targets (e.g. min/max from an operator); streaks and cooldowns carry on."""
        self.config = config

    def settled(self, role: ScaledRole, now: float) -> None:
        """A change of ``role`` took effect at ``now`` (new instances joined, drained ones
        left): its cooldowns count from here rather than from the decision."""
        self._state[role] = _RoleState(last_change=now)

    def decide(
        self,
        obs: Observation,
        now: float,
        *,
        forced: Mapping[ScaledRole, int] | None = None,
        hold: Mapping[ScaledRole, str] | None = None,
    ) -> ScaleDecision:
        """The desired counts for ``obs`` at time ``now`` (seconds, any monotonic origin).

        Args:
            forced: per role, an operator's count to go to regardless of load.
            hold: per role, why the policy must not move it now (e.g. instances joining).

        Returns:
            A decision whose reasons name the numbers behind each change; with no change
            they say what holds each role (hysteresis, cooldown, limits).
        """
        forced = forced or {}
        hold = hold or {}
        verdicts = {}
        for role in ROLES:
            if role in forced:
                verdicts[role] = self._force(role, obs.role(role), forced[role])
            elif role in hold:
                self._state[role].up_streak = self._state[role].down_streak = 0
                n = len(obs.role(role).instances)
                verdicts[role] = _Verdict(n, (), (f"{role}: {hold[role]}",), False)
            else:
                verdicts[role] = self._judge(role, obs.role(role), now)
        is_change = any(v.is_change for v in verdicts.values())
        for role, verdict in verdicts.items():
            if verdict.is_change:
                self._state[role] = _RoleState(last_change=now)
        reasons = [r for v in verdicts.values() if v.is_change == is_change for r in v.reasons]
        p, d = verdicts["prefill"], verdicts["decode"]
        return ScaleDecision(
            prefill=p.desired,
            decode=d.desired,
            reasons=tuple(reasons),
            current_prefill=len(obs.prefill.instances),
            current_decode=len(obs.decode.instances),
            drain=p.drain + d.drain,
            forced=any(v.is_forced and v.is_change for v in verdicts.values()),
        )

    # ------------------------------------------------------------------ one role
    def _force(self, role: ScaledRole, obs: RoleObservation, count: int) -> _Verdict:
        n = len(obs.instances)
        if count == n:
            return _Verdict(n, (), (f"{role}: held at {n} by the operator",), False, True)
        if count > n:
            return _Verdict(
                count, (), (f"{role} {n}->{count}: forced by the operator",), True, True
            )
        drain = _pick_drain(obs.instances, n - count)
        desired = n - len(drain)
        why = f"{role} {n}->{desired}: forced to {count} by the operator"
        if desired != count:
            why += f" (only {len(drain)} removable)"
        if drain:
            why += f"; draining {', '.join(drain)}"
        return _Verdict(desired, drain, (why,), desired != n, True)

    def _judge(self, role: ScaledRole, obs: RoleObservation, now: float) -> _Verdict:
        target = self.config.target(role)
        sig = signals(target, obs)
        n = sig.num_instances
        state = self._state[role]
        if n < target.min_instances:
            return self._fill(role, target, n, now)
        state.below_min_since = None
        if n > target.max_instances:
            return self._shrink(
                role, obs, n - target.max_instances, f"above max {target.max_instances}"
            )
        up = _up_triggers(role, target, sig)
        if up:
            state.up_streak += 1
            state.down_streak = 0
            return self._grow(role, target, n, "; ".join(up), now)
        state.up_streak = 0
        low = _under_watermark(role, target, sig) if n > target.min_instances else None
        if low is None:
            state.down_streak = 0
            return _Verdict(
                n, (), (f"{role}: steady at {n} ({_describe(role, target, sig)})",), False
            )
        state.down_streak += 1
        hold = self._hold_down(role, target, now)
        if hold is not None:
            return _Verdict(n, (), (f"{role}: {hold} ({low})",), False)
        return self._shrink(role, obs, 1, low)

    def _fill(self, role: ScaledRole, target: RoleTarget, n: int, now: float) -> _Verdict:
        """Below min: wait ``fill_after_s`` (a cluster being stopped loses every instance
        before its router), then go to min at once."""
        state = self._state[role]
        if state.below_min_since is None:
            state.below_min_since = now
        waited = now - state.below_min_since
        why = f"below min {target.min_instances} for {waited:.1f}s"
        if waited < self.config.fill_after_s:
            hold = f"{role}: {why} (filling after {self.config.fill_after_s:g}s)"
            return _Verdict(n, (), (hold,), False)
        return _Verdict(
            target.min_instances, (), (f"{role} {n}->{target.min_instances}: {why}",), True
        )

    def _grow(self, role: ScaledRole, target: RoleTarget, n: int, why: str, now: float) -> _Verdict:
        state = self._state[role]
        hold = None
        if n >= target.max_instances:
            hold = f"at max {target.max_instances}"
        elif state.up_streak < target.up_after:
            hold = f"over a limit {state.up_streak}/{target.up_after} evaluations"
        else:
            left = _cooldown_left(state.last_change, target.cooldown_up_s, now)
            if left > 0:
                hold = f"cooling down {left:.1f}s before scaling up"
        if hold is not None:
            return _Verdict(n, (), (f"{role}: {hold} ({why})",), False)
        return _Verdict(n + 1, (), (f"{role} {n}->{n + 1}: {why}",), True)

    def _hold_down(self, role: ScaledRole, target: RoleTarget, now: float) -> str | None:
        state = self._state[role]
        if state.down_streak < target.down_after:
            return f"under the low watermark {state.down_streak}/{target.down_after} evaluations"
        left = _cooldown_left(state.last_change, target.cooldown_down_s, now)
        if left > 0:
            return f"cooling down {left:.1f}s before scaling down"
        return None

    def _shrink(self, role: ScaledRole, obs: RoleObservation, count: int, why: str) -> _Verdict:
        n = len(obs.instances)
        drain = _pick_drain(obs.instances, count)
        if not drain:
            return _Verdict(n, (), (f"{role}: no removable instance ({why})",), False)
        desired = n - len(drain)
        line = f"{role} {n}->{desired}: {why}; draining {', '.join(drain)}"
        return _Verdict(desired, drain, (line,), True)


def _up_triggers(role: ScaledRole, target: RoleTarget, sig: Signals) -> list[str]:
    out = []
    if sig.attainment is not None and sig.attainment < target.target_attainment:
        out.append(
            f"{SLO_METRIC[role]} attainment {sig.attainment:.0%} < {target.target_attainment:.0%}"
            f" (SLO {target.slo_ms:g} ms, {sig.num_samples} requests)"
        )
    if sig.num_instances and sig.queue_per_instance > target.max_queue_per_instance:
        out.append(
            f"queue {sig.queue_per_instance:.1f}/instance > {target.max_queue_per_instance:g}"
        )
    if sig.num_instances and sig.kv_usage > target.max_kv_usage:
        out.append(f"KV usage {sig.kv_usage:.0%} > {target.max_kv_usage:.0%}")
    return out


def _under_watermark(role: ScaledRole, target: RoleTarget, sig: Signals) -> str | None:
    """Why one instance fewer would do, or None when it would not (no up trigger holds)."""
    n = sig.num_instances
    queue = sig.queue_per_instance * n / max(1, n - 1)
    kv = sig.kv_usage * n / max(1, n - 1)
    max_queue = target.scale_down_below * target.max_queue_per_instance
    max_kv = target.scale_down_below * target.max_kv_usage
    if n == 1 and (queue or kv):
        return None
    if queue > max_queue or kv > max_kv:
        return None
    return (
        f"{_attained(role, target, sig)}; on {n - 1}: queue {queue:.1f}/instance"
        f" <= {max_queue:g}, KV {kv:.0%} <= {max_kv:.0%}"
    )


def _attained(role: ScaledRole, target: RoleTarget, sig: Signals) -> str:
    metric = SLO_METRIC[role]
    if sig.attainment is None:
        return f"{metric} attainment unknown ({sig.num_samples} requests)"
    return f"{metric} attainment {sig.attainment:.0%} >= {target.target_attainment:.0%}"


def _describe(role: ScaledRole, target: RoleTarget, sig: Signals) -> str:
    return (
        f"{_attained(role, target, sig)}, queue {sig.queue_per_instance:.1f}/instance,"
        f" KV {sig.kv_usage:.0%}"
    )


def _cooldown_left(last_change: float | None, cooldown_s: float, now: float) -> float:
    return 0.0 if last_change is None else max(0.0, last_change + cooldown_s - now)


def _pick_drain(instances: Sequence[InstanceLoad], count: int) -> tuple[str, ...]:
    """The ``count`` least loaded removable instances, the newest first among equals."""
    removable = [i for i in instances if i.is_removable]
    removable.sort(key=lambda i: (i.num_queued + i.num_running, i.kv_usage, i.age_s))
    return tuple(i.instance_id for i in removable[:count])
