"""The autoscaler's decisions and the hooks that carry them out.

The policy (``policy.py``) turns load reports and SLO attainment into a ``ScaleDecision``:
the desired number of prefill and decode instances, with the reason for each change. A
``ScalingHook`` makes it so on some platform. Hooks are registered by name in
``registry.py`` and imported only when chosen.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any


class HookError(RuntimeError):
    """A hook could not apply a decision (the autoscaler logs it and retries later)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleDecision:
    """Desired instance counts per role, and why."""

    prefill: int  # desired prefill instances
    decode: int  # desired decode instances
    reasons: tuple[
        str, ...
    ] = ()  # one line per change, e.g. "decode 1->2: TPOT attainment 71% < 90%"
    current_prefill: int = 0  # instances counted when deciding
    current_decode: int = 0
    drain: tuple[str, ...] = ()  # instance ids chosen to go on a scale-down (drained first)
    forced: bool = False  # set by an operator (POST /admin/autoscaler), not by the policy
    timestamp: float = dataclasses.field(default_factory=time.time)

    @property
    def is_change(self) -> bool:
        return (self.prefill, self.decode) != (self.current_prefill, self.current_decode)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def env(self) -> dict[str, str]:
        """The decision as environment variables (the ``exec`` hook passes these)."""
        return {
            "KVRELAY_PREFILL": str(self.prefill),
            "KVRELAY_DECODE": str(self.decode),
            "KVRELAY_CURRENT_PREFILL": str(self.current_prefill),
            "KVRELAY_CURRENT_DECODE": str(self.current_decode),
            "KVRELAY_DRAIN": ",".join(self.drain),
            "KVRELAY_REASONS": "\n".join(self.reasons),
            "KVRELAY_FORCED": "1" if self.forced else "0",
        }


class ScalingHook(abc.ABC):
    """Carries a decision out on one platform.

    Contract:
    - ``apply`` makes the platform run ``decision.prefill`` / ``decision.decode``
      instances (idempotent: applying the same decision twice changes nothing more).
    - Scale-down: the autoscaler drains the instances in ``decision.drain`` through the
      router *before* calling ``apply`` and waits until they hold no requests; a hook that
      can pick which instance goes (``local``) removes exactly those; platforms that pick
      on their own (compose, Kubernetes) get the counts only.
    - ``apply`` blocks for at most the hook's timeout and raises ``HookError`` on failure;
      it never raises anything else for a platform problem.
    - Hooks are called from one thread (the autoscaler's); they keep no request state.
    """

    name: str

    @abc.abstractmethod
    def apply(self, decision: ScaleDecision) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional for hooks that hold nothing
        """Releases what the hook holds; the ``local`` hook stops the processes it started."""
