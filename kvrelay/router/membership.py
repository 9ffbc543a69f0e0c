"""Which worker instances a router knows, from the control messages they send it.

The router's side of membership, apart from the requests it places (``dispatcher``):

    Register       -> the registry takes the instance and the connection it came on; an id
                      live on another connection is refused (``refused_control{id_taken}``)
    LoadReport     -> its load, answered with a RegisterAck (``known=False``: register
                      again), which also tells the worker this router is alive
    CacheEvent     -> the prefix index (``CacheIndex``) learns its cached blocks
    LoRAState      -> ``LoRAAdmin``
    Leaving        -> out of the registry at once; ``on_gone(ids, "left")``
    silent past ``dead_after``  -> out of the registry (the reaper); ``on_gone(ids, "gone
                      silent")``

An instance speaks only on the connection it registered from: a LoadReport, CacheEvent or
Leaving for it from another is dropped (``refused_control{foreign_connection}``). The
connection an instance last registered from outlives it while a request in flight still
watches it, so that a late Abort reaches a process that was only paused (``prune``).

The reaper judges on the router's own clock of responsiveness: when the event loop itself was
stalled (its tick came late), the stall is not counted against the instances, whose heartbeats
were waiting in the socket meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvrelay.protocol.messages import (
    CacheEvent,
    Drain,
    Leaving,
    LoadReport,
    LoRAState,
    Register,
    RegisterAck,
    Undrain,
)
from kvrelay.router.lora_admin import LoRAAdmin
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.prefix_index import CacheIndex
from kvrelay.router.registry import Registry

logger = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 1.0  # how often the connections of instances gone are looked at

SendTo = Callable[[bytes, Any], None]  # (connection, message): sends without waiting
OnGone = Callable[[set[str], str], None]  # (instance ids, how): they left the registry
Watched = Callable[[], set[str]]  # instances that requests in flight still depend on


class Membership:
    """Owns the instances' connections; the registry owns the instances themselves."""

    def __init__(
        self,
        registry: Registry,
        cache_index: CacheIndex,
        lora_admin: LoRAAdmin,
        metrics: RouterMetrics,
        router_id: str,
        send_to: SendTo,
        on_gone: OnGone,
    ) -> None:
        self.registry = registry
        self.cache_index = cache_index
        self.lora_admin = lora_admin
        self.metrics = metrics
        self.router_id = router_id
        self._send_to = send_to
        self._on_gone = on_gone
        # instance id -> the connection it last registered from (its Aborts reach it even
        # after the router declared it dead: a paused process finds them when it resumes);
        # a dead one's is dropped once no request in flight watches it (prune)
        self.connections: dict[str, bytes] = {}

    def connection(self, instance_id: str) -> bytes | None:
        """The connection ``instance_id`` last registered from, dead or alive (None: never
        seen, or pruned)."""
        return self.connections.get(instance_id)

    def on_message(self, identity: bytes, msg: Any) -> None:
        """One membership message (the table above); ``identity`` is its connection."""
        if isinstance(msg, Register):
            self.register(identity, msg)
        elif isinstance(msg, LoRAState):
            self.lora_admin.on_state(identity, msg)
        elif isinstance(msg, Leaving):
            if self.registry.get_from(msg.instance_id, identity) is None:
                self.metrics.refused_control.labels("foreign_connection").inc()
            else:
                self.registry.remove(msg.instance_id)
                self._on_gone({msg.instance_id}, "left")
        elif isinstance(msg, LoadReport | CacheEvent):
            self._on_report(identity, msg)
        else:
            logger.warning("unexpected %s from %r", type(msg).__name__, identity)

    def _on_report(self, identity: bytes, msg: LoadReport | CacheEvent) -> None:
        if self.registry.get(msg.instance_id) is None:
            if isinstance(msg, LoadReport):
                logger.info("heartbeat from unregistered %s: asked to register", msg.instance_id)
                self._send_to(identity, self._ack(msg.instance_id, known=False))
        elif self.registry.get_from(msg.instance_id, identity) is None:
            self.metrics.refused_control.labels("foreign_connection").inc()
        elif isinstance(msg, LoadReport):
            self.registry.report(msg)
            # the answer also tells the worker this router is alive (router_timeout)
            self._send_to(identity, self._ack(msg.instance_id, known=True))
        else:
            self.cache_index.apply(msg)

    def _ack(self, instance_id: str, known: bool) -> RegisterAck:
        return RegisterAck(instance_id, known, self.router_id, token_batches=True)

    def register(self, identity: bytes, msg: Register) -> None:
        """Takes an instance in (or refuses it: its id is live on another connection)."""
        inst = self.registry.register(msg, identity)
        if inst is None:
            self.metrics.refused_control.labels("id_taken").inc()
            logger.warning(
                "refused a Register of %s from %r: the id is live on another connection",
                msg.info.instance_id,
                identity,
            )
            return
        self.cache_index.add_instance(inst.instance_id, inst.info.host_id)
        self.connections[inst.instance_id] = identity  # kept after death: late Aborts
        self._send_to(identity, self._ack(inst.instance_id, known=True))
        self.lora_admin.on_register(inst)
        logger.info("instance %s (%s) joined", inst.instance_id, inst.role.value)

    def forget(self, gone: set[str]) -> None:
        """Drops what instances out of the registry left behind: cached prefixes, adapters."""
        for instance_id in gone:
            self.cache_index.remove_instance(instance_id)
            self.lora_admin.on_leave(instance_id)

    def set_draining(self, instance_id: str, draining: bool) -> bool:
        """Stops (or resumes) placing requests on an instance and tells it so; False if
        unknown."""
        inst = self.registry.get(instance_id)
        if inst is None:
            return False
        inst.draining = draining
        self._send_to(inst.connection, Drain(instance_id) if draining else Undrain(instance_id))
        return True

    def prune(self, watched: Watched) -> int:
        """Forgets the connections of instances that left the registry and that no request
        in flight watches (a late Abort has nothing left to stop there); returns how many.
        Without this an autoscaled fleet's router kept one entry per instance ever seen."""
        gone = [i for i in self.connections if self.registry.get(i) is None]
        if not gone:
            return 0
        still = watched()
        dropped = [i for i in gone if i not in still]
        for instance_id in dropped:
            del self.connections[instance_id]
        return len(dropped)

    async def reap_loop(self, dead_after: float, watched: Watched) -> None:
        """Declares instances silent past ``dead_after`` dead (``on_gone``), and prunes the
        connections of the dead every ``PRUNE_INTERVAL_S``; runs until cancelled."""
        interval = min(0.2, dead_after / 4)
        last_tick = last_prune = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            overshoot = now - last_tick - interval
            last_tick = now
            if overshoot > interval:  # more than a late wake-up: the loop itself was held
                self.registry.excuse(overshoot)  # heartbeats waited in the socket meanwhile
                self.metrics.loop_stalls.inc()
                continue  # let the receive loop catch up before judging
            dead = {inst.instance_id for inst in self.registry.reap()}
            if now - last_prune >= PRUNE_INTERVAL_S:
                last_prune = now
                self.prune(watched)
            if dead:
                self._on_gone(dead, "gone silent")
