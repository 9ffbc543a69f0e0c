"""LoRA adapters loaded and unloaded while the cluster runs (vLLM's ``/v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``; the router's ``--allow-runtime-lora-updating``).

A load sends ``LoRAUpdate`` to every live worker and waits for each one's ``LoRAState`` (every
router gets those, so each keeps the registry's view of who holds what). All or nothing: when
a worker fails (a bad path, files that do not fit the model, a name it holds from other files)
the workers that did load it unload it again, and the call fails with the worker's reason. A
worker that joins later is sent the adapters loaded here at runtime, so a scale-up serves them
too (workers started with ``--lora-modules`` have theirs already). An unload waits the same
way; requests already running on the adapter finish on it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.protocol.lora_modules import check_name
from kvrelay.protocol.messages import LoRAState, LoRAUpdate
from kvrelay.router.errors import ApiError
from kvrelay.router.instance import Instance
from kvrelay.router.registry import Registry

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0  # seconds a load or unload waits for every worker's answer


@dataclass(slots=True)
class _Pending:
    waiting: set[str]  # instance ids that have not answered yet
    errors: dict[str, str] = field(default_factory=dict)  # instance id -> why it failed
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def answer(self, instance_id: str, error: str) -> None:
        if instance_id in self.waiting:
            self.waiting.discard(instance_id)
            if error:
                self.errors[instance_id] = error
        if not self.waiting:
            self.done.set()


class LoRAAdmin:
    def __init__(
        self,
        registry: Registry,
        send: Callable[[Instance, Any], None],
        base_names: tuple[str, ...] = (),
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.registry = registry
        self._send = send
        self.base_names = base_names  # the base model's served names: no adapter takes one
        self.timeout = timeout
        self.runtime: dict[str, str] = {}  # adapters loaded here at runtime: name -> path
        self._pending: dict[str, _Pending] = {}

    async def load(self, name: str, path: str) -> None:
        """Loads ``name`` from ``path`` on every live worker, or on none (``ApiError``)."""
        try:
            check_name(name)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_name") from None
        if not path:
            raise ApiError(400, "'lora_path' must be a directory on the workers", param="lora_path")
        if name in self.base_names:
            raise ApiError(
                400, f"'{name}' is the base model's name: give the adapter another",
                param="lora_name",
            )  # fmt: skip
        if self.registry.lora_adapter(name) is not None or name in self.runtime:
            raise ApiError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        workers = self.registry.instances()
        if not workers:
            raise ApiError(503, "no worker instance is ready", type="server_error")
        errors, unanswered = await self._update(workers, LoRAUpdate(name, path))
        if errors:
            # all or nothing: unload where it loaded, and where no answer came (it may yet)
            for inst in workers:
                if inst.instance_id not in errors or inst.instance_id in unanswered:
                    self._send(inst, LoRAUpdate(name, unload=True))
            instance_id, why = next(iter(sorted(errors.items())))
            raise ApiError(400, f"loading LoRA adapter '{name}' failed on {instance_id}: {why}",
                           param="lora_path")  # fmt: skip
        self.runtime[name] = path
        logger.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(workers))

    async def unload(self, name: str) -> None:
        """Drops ``name`` from every worker that holds it (``ApiError`` when none does)."""
        holders = [i for i in self.registry.instances() if name in i.lora_adapters]
        self.runtime.pop(name, None)
        if not holders:
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                code="not_found",
            )  # fmt: skip
        errors, _ = await self._update(holders, LoRAUpdate(name, unload=True))
        if errors:
            instance_id, why = next(iter(sorted(errors.items())))
            raise ApiError(400, f"unloading LoRA adapter '{name}' failed on {instance_id}: {why}")
        logger.info("LoRA adapter %s unloaded from %d workers", name, len(holders))

    async def _update(
        self, workers: list[Instance], update: LoRAUpdate
    ) -> tuple[dict[str, str], set[str]]:
        """Sends ``update`` to ``workers``; their errors by instance id (a worker that does
        not answer in time counts as one), and the ids of those that did not answer."""
        request_id = uuid.uuid4().hex
        pending = _Pending({w.instance_id for w in workers})
        self._pending[request_id] = pending
        try:
            for inst in workers:
                self._send(inst, LoRAUpdate(update.name, update.path, update.unload, request_id))
            try:
                await asyncio.wait_for(pending.done.wait(), self.timeout)
            except TimeoutError:
                for instance_id in pending.waiting:
                    pending.errors[instance_id] = f"no answer within {self.timeout:.0f} s"
            return pending.errors, set(pending.waiting)
        finally:
            del self._pending[request_id]

    def on_state(self, identity: bytes, msg: LoRAState) -> None:
        """A worker's adapters after an update (this router's or another's)."""
        if not self.registry.set_lora_adapters(msg.instance_id, identity, msg.lora_adapters):
            return  # not registered from that connection
        pending = self._pending.get(msg.request_id)
        if pending is not None:
            pending.answer(msg.instance_id, msg.error)
        elif msg.error:
            logger.warning("%s: a LoRA update failed: %s", msg.instance_id, msg.error)

    def on_register(self, inst: Instance) -> None:
        """Sends a joining worker the adapters loaded here at runtime that it lacks; warns of
        an adapter it names like the base model (requests for that name get the base)."""
        for name in inst.lora_adapters:
            if name in self.base_names:
                logger.warning(
                    "%s has a LoRA adapter named %r, the base model's name: requests for %r "
                    "run on the base model (name the adapter otherwise)", inst.instance_id,
                    name, name,
                )  # fmt: skip
        for name, path in self.runtime.items():
            if name not in inst.lora_adapters:
                self._send(inst, LoRAUpdate(name, path))

    def on_leave(self, instance_id: str) -> None:
        """A worker that left answers no pending update: it no longer holds anything."""
        for pending in self._pending.values():
            pending.answer(instance_id, "")
