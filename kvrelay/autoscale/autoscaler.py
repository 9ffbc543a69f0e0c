"""The autoscaler: an asyncio task in the router that observes, decides and applies.

Every ``interval_s``::

    observe   registry (live, non-draining prefill / decode instances and their load)
              + the backend's finished-request latencies of the last window
    decide    Policy.decide(observation, now, forced=operator counts, hold=roles not to move)
    apply     scale-down: backend.drain(id) for each instance in decision.drain, wait until
                  no request in flight depends on it and a fresh load report shows it idle
                  (bounded: after drain_timeout_s it goes anyway; the router re-runs what it
                  still held elsewhere, so requests move instead of failing), then the hook
              scale-up: the hook; the role is held until the new instances have joined the
                  registry (workers register only once ready) or join_timeout_s passed
    settle    after a scale-down the role is held until the registry counts no more than
              the new number (or settle_timeout_s passed); then every drained instance still
              registered is undrained. The local hook removes exactly the drained ones, so
              none is left; compose and Kubernetes pick a replica themselves, and the drained
              instance may be the one that stays. A hook that fails undrains them at once.

One operation at a time: the loop waits for it, so decisions never overlap. The hook runs in
one dedicated thread (the contract of ``ScalingHook``), never on the event loop. Operators
steer it with ``update`` (``POST /admin/autoscaler``) and read ``state``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvrelay.autoscale.base import HookError, ScaleDecision, ScalingHook
from kvrelay.autoscale.policy import (
    ROLES,
    InstanceLoad,
    Observation,
    Policy,
    RoleObservation,
    ScaledRole,
    signals,
)
from kvrelay.protocol.messages import Role

if TYPE_CHECKING:
    from kvrelay.router.dispatcher import Dispatcher
    from kvrelay.router.instance import Instance
    from kvrelay.router.registry import Registry
    from kvrelay.router.tracked import LatencySample

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.1


@runtime_checkable
class OwningHook(Protocol):
    """A hook that removes only instances it started (``local``): the policy drains only
    those, and ``describe()`` shows what it holds in ``GET /admin/autoscaler``."""

    def owns(self, instance_id: str) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


class UpdateError(ValueError):
    """An operator's update was refused; ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscalerSettings:
    interval_s: float = 2.0  # seconds between evaluations
    drain_timeout_s: float = 120.0  # longest wait for a drained instance to go idle
    join_timeout_s: float = 180.0  # longest hold of a role while its new instances join
    settle_timeout_s: float = 60.0  # longest hold of a role while the platform removes some
    startup_grace_s: float = 120.0  # a role is left alone until it first has min instances
    num_decisions: int = 50  # decisions kept for GET /admin/autoscaler
    num_errors: int = 20  # errors kept

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclasses.dataclass(slots=True)
class _Joining:
    count: int  # instances the role should reach
    deadline: float  # monotonic


@dataclasses.dataclass(frozen=True, slots=True)
class _Settling:
    """A scale-down the platform is carrying out."""

    count: int  # registered instances the role should come down to
    drained: tuple[str, ...]  # what the autoscaler drained for it
    deadline: float  # monotonic


class Autoscaler:
    def __init__(
        self,
        backend: Dispatcher,
        hook: ScalingHook,
        policy: Policy,
        settings: AutoscalerSettings | None = None,
    ) -> None:
        self.backend = backend
        self.hook = hook
        self.policy = policy
        self.settings = settings or AutoscalerSettings()
        self.enabled = True
        self.forced: dict[ScaledRole, int] = {}
        self._joining: dict[ScaledRole, _Joining] = {}
        self._settling: dict[ScaledRole, _Settling] = {}
        self._first_seen: dict[str, float] = {}
        self._decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=self.settings.num_decisions
        )
        self._errors: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=self.settings.num_errors
        )
        self._last_reasons: tuple[str, ...] = ()
        self._started = time.monotonic()
        self._came_up: set[ScaledRole] = set()  # roles that had min instances once
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "autoscaler-hook")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._loop(), name="autoscaler")
        self._task.add_done_callback(self._on_loop_done)

    async def stop(self) -> None:
        """Stops the loop and closes the hook.

        ``close`` runs in a thread of its own: a shutdown must not wait out a scale-up still
        running in the hook thread, so the hook's ``close`` has to make that ``apply``
        return (the local hook stops waiting for its new workers and ends them).
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.to_thread(self.hook.close)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("autoscaler stopped", exc_info=task.exception())
            self._error(f"autoscaler stopped: {task.exception()!r}")

    async def _loop(self) -> None:
        while True:
            await self.run_once()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.interval_s)
            self._wake.clear()

    # ------------------------------------------------------------------ one evaluation
    async def run_once(self) -> ScaleDecision:
        """Observes, decides and, on a change, drains and applies; returns the decision."""
        now = time.monotonic()
        obs = self.observe(now)
        # a role whose instances are joining or leaving waits, forced or not: a forced count
        # compared with the instances registered so far would add (or drain) them again
        hold = self._holds(obs, now)
        forced = {role: count for role, count in self.forced.items() if role not in hold}
        if not self.enabled:
            for role in ROLES:
                hold.setdefault(role, "autoscaling disabled")
        decision = self.policy.decide(obs, now, forced=forced, hold=hold)
        self._last_reasons = decision.reasons
        if decision.is_change:
            await self._execute(decision)
        return decision

    def observe(self, now: float) -> Observation:
        window = self.policy.config.window_s
        samples = self.backend.recent_latencies(window)
        known = {i.instance_id for i in self.backend.registry.instances()}
        for instance_id in set(self._first_seen) - known:
            del self._first_seen[instance_id]
        return Observation(
            prefill=self._role_observation(Role.PREFILL, samples, now),
            decode=self._role_observation(Role.DECODE, samples, now),
            request_rate=len(samples) / window,
        )

    def _role_observation(
        self, role: Role, samples: list[LatencySample], now: float
    ) -> RoleObservation:
        live = live_instances(self.backend.registry, role)
        ages = {i.instance_id: now - self._first_seen.setdefault(i.instance_id, now) for i in live}
        return role_observation(role, live, samples, ages, self._is_removable)

    def _is_removable(self, instance_id: str) -> bool:
        return not isinstance(self.hook, OwningHook) or self.hook.owns(instance_id)

    def _holds(self, obs: Observation, now: float) -> dict[ScaledRole, str]:
        """Roles nothing may move now, and why: the cluster coming up, instances joining,
        the platform removing some."""
        holds: dict[ScaledRole, str] = {}
        for role in set(ROLES) - self._came_up:
            n, wanted = len(obs.role(role).instances), self.policy.config.target(role).min_instances
            if n >= wanted or now - self._started >= self.settings.startup_grace_s:
                self._came_up.add(role)
            else:
                holds[role] = f"waiting for the cluster to come up ({n} of {wanted} joined)"
        for role, joining in list(self._joining.items()):
            num_live = len(obs.role(role).instances)
            if num_live >= joining.count:
                del self._joining[role]
                self.policy.settled(role, now)
            elif now >= joining.deadline:
                del self._joining[role]
                self._error(
                    f"{role}: {num_live} of {joining.count} instances joined within "
                    f"{self.settings.join_timeout_s:g}s"
                )
            else:
                holds[role] = f"waiting for {joining.count - num_live} instance(s) to join"
        for role in list(self._settling):
            num_left = self._settle(role, now)
            if num_left:
                holds[role] = f"waiting for the platform to remove {num_left} instance(s)"
        return holds

    def _settle(self, role: ScaledRole, now: float) -> int:
        """How many instances the platform has still to remove; at 0 (or the deadline)
        undrains what was drained for the scale-down and is still registered."""
        settling = self._settling[role]
        num_left = len(self.backend.registry.instances(Role(role))) - settling.count
        if num_left > 0 and now < settling.deadline:
            return num_left
        if num_left > 0:
            self._error(
                f"{role}: {num_left} instance(s) more than {settling.count} still registered "
                f"{self.settings.settle_timeout_s:g}s after the scale-down"
            )
        del self._settling[role]
        self._undrain(settling.drained)
        return 0

    def _undrain(self, instance_ids: tuple[str, ...]) -> None:
        for instance_id in instance_ids:
            if self.backend.undrain(instance_id):
                logger.info("autoscaler: %s stayed; taking requests again", instance_id)

    # ------------------------------------------------------------------ applying
    async def _execute(self, decision: ScaleDecision) -> None:
        record = {**decision.as_dict(), "status": "draining" if decision.drain else "applying"}
        self._decisions.append(record)
        logger.info("autoscaler: %s", "; ".join(decision.reasons))
        started = time.monotonic()
        for instance_id in decision.drain:
            self.backend.drain(instance_id)
        await asyncio.gather(*(self._wait_drained(i) for i in decision.drain))
        record["status"] = "applying"
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self.hook.apply, decision)
        except HookError as e:
            record.update(status="failed", error=str(e))
            self._error(f"{self.hook.name} hook: {e}")
            self._undrain(decision.drain)  # nothing was removed
            return
        finally:
            record["duration_s"] = round(time.monotonic() - started, 3)
        record["status"] = "applied"
        now = time.monotonic()
        for role, (current, desired) in _counts(decision).items():
            if desired != current:
                self.policy.settled(role, now)  # cooldowns count from the change, not the decision
            if desired > current:
                self._joining[role] = _Joining(desired, now + self.settings.join_timeout_s)
            elif desired < current:
                drained = tuple(
                    i for i in decision.drain if (inst := self.backend.registry.get(i)) is not None
                    and inst.role is Role(role)
                )  # fmt: skip
                deadline = now + self.settings.settle_timeout_s
                self._settling[role] = _Settling(desired, drained, deadline)

    async def _wait_drained(self, instance_id: str) -> None:
        """Returns once nothing depends on the instance, it is gone, or the timeout passed."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        idle_since: float | None = None
        while time.monotonic() < deadline:
            inst = self.backend.registry.get(instance_id)
            if inst is None:
                return  # gone: the router re-ran what it held
            load = inst.load
            busy = (
                self.backend.num_requests_on(instance_id)
                or load.num_waiting
                or load.num_running
                or load.num_pending_kv
            )
            if busy:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif inst.last_seen > idle_since:
                return  # a load report sent after the last request left says idle
            await asyncio.sleep(_DRAIN_POLL_S)
        self._error(
            f"{instance_id} still busy {self.settings.drain_timeout_s:g}s after drain; removing "
            "it anyway (the router re-runs its requests elsewhere)"
        )

    def _error(self, message: str) -> None:
        logger.warning("autoscaler: %s", message)
        self._errors.append({"timestamp": time.time(), "message": message})

    # ------------------------------------------------------------------ operators
    def state(self) -> dict[str, Any]:
        """What ``GET /admin/autoscaler`` returns."""
        now = time.monotonic()
        obs = self.observe(now)
        current: dict[str, Any] = {"request_rate": round(obs.request_rate, 3)}
        for role in ROLES:
            target = self.policy.config.target(role)
            sig = signals(target, obs.role(role))
            draining = [
                i.instance_id
                for i in self.backend.registry.instances(Role(role))
                if i.draining or i.load.draining
            ]
            current[role] = {
                "count": sig.num_instances,
                "instances": [i.instance_id for i in obs.role(role).instances],
                "draining": draining,
                "attainment": sig.attainment,
                "num_samples": sig.num_samples,
                "queue_per_instance": round(sig.queue_per_instance, 3),
                "kv_usage": round(sig.kv_usage, 4),
            }
        hook: dict[str, Any] = {"name": self.hook.name}
        if isinstance(self.hook, OwningHook):
            hook.update(self.hook.describe())
        return {
            "enabled": self.enabled,
            "running": self._task is not None and not self._task.done(),
            "hook": hook,
            "interval_s": self.settings.interval_s,
            "window_s": self.policy.config.window_s,
            "targets": {r: dataclasses.asdict(self.policy.config.target(r)) for r in ROLES},
            "forced": dict(self.forced),
            "joining": {r: j.count for r, j in self._joining.items()},
            "settling": {r: s.count for r, s in self._settling.items()},
            "current": current,
            "last_evaluation": list(self._last_reasons),
            "recent_decisions": list(self._decisions),
            "errors": list(self._errors),
        }

    def update(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Applies ``POST /admin/autoscaler``; all or nothing. Returns the new state.

        ``{"enabled": bool, "min": {role: n}, "max": {role: n}, "force": {role: n | null}}``,
        every key optional. A forced count holds the role there (enabled or not) until
        it is set to null; it must lie within the role's min and max.

        Raises:
            UpdateError: an unknown key, a wrong type or an inconsistent value, named.
        """
        unknown = set(body) - {"enabled", "min", "max", "force"}
        if unknown:
            raise UpdateError(
                f"unknown field(s) {sorted(unknown)}; valid: enabled, min, max, force",
                sorted(unknown)[0],
            )
        enabled = body.get("enabled", self.enabled)
        if not isinstance(enabled, bool):
            raise UpdateError(f"'enabled' must be true or false, got {enabled!r}", "enabled")
        config = self.policy.config
        for key, field in (("min", "min_instances"), ("max", "max_instances")):
            for role, value in _role_counts(body, key, allow_null=False).items():
                try:
                    config = config.with_target(role, **{field: value})
                except ValueError as e:
                    raise UpdateError(f"{key}.{role}: {e}", f"{key}.{role}") from None
        forced = dict(self.forced)
        for role, value in _role_counts(body, "force", allow_null=True).items():
            if value is None:
                forced.pop(role, None)
            else:
                forced[role] = value
        for role, value in forced.items():
            target = config.target(role)
            if not target.min_instances <= value <= target.max_instances:
                raise UpdateError(
                    f"force.{role}={value} is outside min {target.min_instances} .. max "
                    f"{target.max_instances}; change min/max first",
                    f"force.{role}",
                )
        self.enabled = enabled
        self.policy.reconfigure(config)
        self.forced = forced
        self._wake.set()
        return self.state()


def live_instances(registry: Registry, role: Role) -> list[Instance]:
    """The role's instances the policy counts: registered and not draining."""
    return [i for i in registry.instances(role) if not (i.draining or i.load.draining)]


def instance_load(inst: Instance, age_s: float, is_removable: bool) -> InstanceLoad:
    """One instance as the policy sees it, from the router's view of its load."""
    load = inst.load
    queued = load.num_waiting + inst.num_assigned
    if inst.role is Role.DECODE:
        queued += load.num_pending_kv  # hand-offs waiting for room
    return InstanceLoad(
        instance_id=inst.instance_id,
        num_queued=queued,
        num_running=load.num_running,
        kv_usage=1.0 - load.num_free_blocks / max(1, load.num_total_blocks),
        age_s=age_s,
        is_removable=is_removable,
    )


def role_observation(
    role: Role,
    live: Sequence[Instance],
    samples: Sequence[LatencySample],
    ages: Mapping[str, float],
    is_removable: Callable[[str], bool],
) -> RoleObservation:
    """What the policy reads for one role: its live instances' loads (``ages``: seconds since
    each joined) and the window's TTFTs (prefill) or mean TPOTs (decode), in ms. Pure: the
    autoscaler and the simulator (``kvrelay.sim``) both build observations with it."""
    instances = tuple(
        instance_load(i, ages.get(i.instance_id, 0.0), is_removable(i.instance_id)) for i in live
    )
    if role is Role.PREFILL:
        latencies = tuple(s.ttft_s * 1000 for s in samples)
    else:
        latencies = tuple(s.tpot_s * 1000 for s in samples if s.tpot_s is not None)
    return RoleObservation(instances, latencies)


def _counts(decision: ScaleDecision) -> dict[ScaledRole, tuple[int, int]]:
    """Per role, (current, desired)."""
    return {
        "prefill": (decision.current_prefill, decision.prefill),
        "decode": (decision.current_decode, decision.decode),
    }


def _role_counts(body: Mapping[str, Any], key: str, allow_null: bool) -> dict[ScaledRole, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UpdateError(f"'{key}' must be an object like {{\"decode\": 2}}", key)
    out: dict[ScaledRole, Any] = {}
    for role, count in value.items():
        if role not in ROLES:
            raise UpdateError(f"{key}: role must be prefill or decode, got {role!r}", key)
        if count is None and allow_null:
            out[role] = None
        elif isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise UpdateError(
                f"{key}.{role} must be an integer >= 0, got {count!r}", f"{key}.{role}"
            )
        else:
            out[role] = count
    return out
