"""The worker process: one engine, a control link to the router, a peer socket, probes.

One thread runs everything that touches the engine::

    loop:  poll sockets (0 ms when the engine has work, else up to 20 ms)
           handle messages      GenerateRequest / Abort / (Un)Drain / Shutdown from the router,
                                KvReady / KvAck / KvPull from peers (role hooks)
           orphans              abort the requests of a router silent for router_timeout
                                (checked after the poll, so a long step never looks like it)
           engine.step()        -> the step's TokenEvents, one message per router (role hook:
                                prefill sends each at once and hands off); a worker at a
                                lowered CPU priority steps a prompt of its own at nice 0
                                (``cpu_priority.follow_prompts``)
           housekeeping         heartbeat LoadReport, lease expiry, pending imports (roles)

SIGTERM drains (``begin_exit``): the instance reports ``draining`` at once, so the routers
place nothing new on it; it finishes what it runs, its hand-offs included, and exits 0 once
idle, or when ``drain_timeout`` runs out (the routers retry what was left elsewhere). A second
SIGTERM exits at once. The routers' Drain / Undrain (the autoscaler's) never undo an exit.

The colocated role is this class as it is; ``prefill/worker.py`` and ``decode/worker.py``
add the KV hand-off. The links live apart: ``router_links`` (which router hears what, the
heartbeat thread) and ``peer_links`` (messages between workers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, cast

import zmq

from kvrelay import envs
from kvrelay.cachetier.param_pool import ParamPool
from kvrelay.engine.admission import RequestError
from kvrelay.engine.device import resolve_device
from kvrelay.engine.engine import LLMEngine, build_engine_config
from kvrelay.engine.lora import LoRAError
from kvrelay.engine.outputs import RequestOutput
from kvrelay.protocol.errors import ProtocolError
from kvrelay.protocol.messages import (
    KV_HANDOFF_VERSION,
    Abort,
    CacheEvent,
    CacheTier,
    Drain,
    GenerateRequest,
    KvLayout,
    Leaving,
    LoadReport,
    LoRAState,
    LoRAUpdate,
    PeerInfo,
    Register,
    RegisterAck,
    RouterLeaving,
    Shutdown,
    TokenEvent,
    Undrain,
    decode,
)
from kvrelay.transport.curve import SocketSecurity, describe
from kvrelay.worker import cpu_priority
from kvrelay.worker import stats as worker_stats
from kvrelay.worker.cache_feed import DeviceCacheFeed
from kvrelay.worker.config import (
    WorkerConfig,
    check_transport_for_device,
    create_tiers,
    default_host_id,
    layout_from_shape,
    open_param_pool,
    pool_weights,
    resolve_identity,
)
from kvrelay.worker.kv_export import KvExport
from kvrelay.worker.metrics import WorkerMetrics
from kvrelay.worker.peer_links import PeerLinks
from kvrelay.worker.router_links import RouterLinks, token_event
from kvrelay.worker.status import StatusServer

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 20


class Worker:
    role_name = "colocated"
    # a step's token events go to each router as one message (RouterLinks.batch)
    batch_events = True

    def __init__(self, config: WorkerConfig) -> None:
        config = resolve_identity(config, socket.gethostname(), os.getpid())
        self.config = config
        self.instance_id = config.instance_id
        engine_config = build_engine_config(config.model, **dict(config.engine_args))
        self.device = resolve_device(engine_config.device)
        check_transport_for_device(config.transport, self.device)
        self.ctx = zmq.Context()
        self.security = SocketSecurity(config.credential)
        logger.info("%s: %s", config.instance_id, describe(self.security))
        self.metrics = WorkerMetrics(config.instance_id, config.role.value)
        self.kv_export = KvExport(config.cluster_id, config.instance_id, config.transport)
        self.tiers = create_tiers(config, engine_config)
        self.param_pool = self._open_param_pool(engine_config.dtype)
        self.engine = LLMEngine(
            engine_config,
            tokenizer=None,
            kv_allocator=self.kv_export.allocate,
            tiers=self.tiers,
            weights=None if self.param_pool is None else pool_weights(self.param_pool, self.device),
        )
        if self.device.type == "cuda":  # Triton's JIT and every CUDA graph, before serving
            warm = self.engine.warm_up()
            logger.info("%s: engine warmed up in %.2f s", config.instance_id, warm)
        self.layout = self._layout()
        self.routers = RouterLinks(
            self.ctx, config.instance_id, config.router_addr, config.heartbeat_interval,
            self.security,
        )  # fmt: skip
        self.peers = PeerLinks(
            self.ctx, config.instance_id, config.host, config.peer_port, self.security
        )
        self.peer = self.peers.socket
        self.metrics.watch_tiers(self.tier_stats)
        self.status = StatusServer(
            config.host, config.status_port, self.metrics.registry, self.is_ready, self.stats
        )
        self.info = self._peer_info(self.peers.port)
        self._poller = zmq.Poller()
        for ctrl in self.routers.links:
            self._poller.register(ctrl, zmq.POLLIN)
        self._poller.register(self.peer, zmq.POLLIN)
        self._cache_feed = DeviceCacheFeed()  # device-cache changes for the routers
        self._running = True
        self.registered = False
        self.draining = False
        self._exit_deadline: float | None = None  # set by SIGTERM: drain, then exit
        self._last_report = 0.0
        self._last_orphan_check = 0.0
        self._last_loop_tick = time.monotonic()

    # ------------------------------------------------------------------ set-up
    def _open_param_pool(self, dtype: str) -> ParamPool | None:
        """The host's parameter pool of this model, or None (disabled, or no room for it)."""
        if not self.config.param_pool:
            return None
        try:
            return open_param_pool(self.config, dtype, self.security)
        except OSError as e:  # e.g. /dev/shm too small: the weights go to private memory
            logger.warning(
                "%s: no parameter pool (%s); loading from disk", self.config.instance_id, e
            )
            return None

    def _peer_info(self, peer_port: int) -> PeerInfo:
        """What peers and routers learn of this instance (sent in ``Register``)."""
        config = self.config
        public = config.advertise_host
        return PeerInfo(
            instance_id=config.instance_id,
            role=config.role,
            host_id=config.host_id or default_host_id(),
            peer_addr=f"tcp://{public}:{peer_port}",
            status_url=f"http://{public}:{self.status.port}",
            kv_segment=self.kv_export.segment,
            layout=self.layout,
            fingerprint=self.engine.fingerprint,
            transport=self._asked_transport(),
            kv_version=KV_HANDOFF_VERSION,
        )

    def _asked_transport(self) -> str:
        """What this instance asks peers for: a GPU pool exported over IPC asks for cuda_ipc."""
        if (
            self.config.transport == "auto"
            and self.device.type == "cuda"
            and self.kv_export.segment
        ):
            return "cuda_ipc"
        return self.config.transport

    def _layout(self) -> KvLayout:
        return layout_from_shape(
            tuple(self.engine.runner.kv_cache.shape), self.engine.runner.kv_cache.dtype
        )

    def is_ready(self) -> bool:
        """Up, registered with a router, and taking requests."""
        return self._running and self.registered and not self.is_draining

    def stats(self) -> dict[str, Any]:
        bm = self.engine.block_manager
        return {
            "instance_id": self.instance_id,
            "role": self.config.role.value,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_used_blocks": bm.num_leaked(),
            "num_leaked_blocks": self.num_leaked_blocks(),
            "num_waiting": self.engine.scheduler.num_waiting,
            "num_running": self.engine.scheduler.num_running,
            "tiers": self.tier_stats(),
        }

    def tier_stats(self) -> dict[str, Any]:
        """Per tier: this instance's queries and hits (tokens and blocks), sizes, errors."""
        return worker_stats.tier_stats(self.engine, self.tiers)

    def num_leaked_blocks(self) -> int:
        """Block references that no running sequence, lease or import accounts for."""
        held = sum(len(s.block_ids) for s in self.engine.scheduler.running)
        return self.engine.block_manager.num_refs() - held - self.num_role_held_refs()

    def num_role_held_refs(self) -> int:
        return 0

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.on_sigterm())
        self.status.start()
        self.register()
        logger.info(
            "%s ready: peer %s, status %s, kv %s",
            self.instance_id,
            self.info.peer_addr,
            self.info.status_url,
            "cuda-ipc" if self.device.type == "cuda" else self.kv_export.segment or "private",
        )
        # the grammar compiler's tables (about 1 s) build while the worker already serves;
        # after the log line, which its import (holding the GIL) would otherwise delay
        if envs.get("KVRELAY_GRAMMAR_WARM_UP"):
            self.engine.grammars.warm_up_in_background()
        self.routers.snapshot = self.load_report()
        self.routers.start_heartbeat(lambda: self._running)
        try:
            while self._running:
                busy = self.engine.has_unfinished_requests() or self.has_role_work()
                self._poll(0 if busy else _IDLE_POLL_MS)
                self._abort_orphans()
                if cpu_priority.follow_prompts(self.engine.scheduler.has_prefill_work):
                    self.metrics.priority_raises.inc()
                if self.engine.has_unfinished_requests():
                    self._step()
                self.housekeeping()
                self._check_exit()
        finally:
            self.close()

    @property
    def is_draining(self) -> bool:
        """Takes no new requests: drained by a router, or exiting."""
        return self.draining or self._exit_deadline is not None

    def on_sigterm(self) -> None:
        """The first SIGTERM drains then exits (``begin_exit``); a second exits at once."""
        if self._exit_deadline is None:
            self.begin_exit()
        else:
            logger.warning("%s: second SIGTERM; exiting without draining", self.instance_id)
            self.stop()

    def begin_exit(self) -> None:
        """Stops taking requests and exits once idle or after ``drain_timeout``. Only sets
        state: the loop thread sends the draining report and checks for the exit."""
        self._exit_deadline = time.monotonic() + self.config.drain_timeout
        self._last_report = 0.0  # the next housekeeping reports ``draining`` to the routers

    def _check_exit(self) -> None:
        """While exiting: stop once nothing runs, waits or is handed off, or at the deadline."""
        if self._exit_deadline is None:
            return
        is_idle = not self.engine.has_unfinished_requests() and self.num_pending_kv() == 0
        if is_idle:
            logger.info("%s: drained; exiting", self.instance_id)
            self.stop()
        elif time.monotonic() >= self._exit_deadline:
            logger.warning(
                "%s: drain timeout (%.0f s) with %d request(s) left; exiting",
                self.instance_id, self.config.drain_timeout, self.engine.scheduler.num_running,
            )  # fmt: skip
            self.stop()

    def register(self, links: list[zmq.Socket] | None = None) -> None:
        """Sends Register and the full device-cache state (deltas follow on heartbeats)."""
        msg = Register(
            self.info, self.served_model_name(), self.engine.max_model_len, os.getpid(),
            lora_adapters=self.lora_identities(),
            embedding_size=self.engine.config.model_config.hidden_size,
            cpu_nice=cpu_priority.lowered_by(),
        )  # fmt: skip
        self.routers.send(msg, links)
        cached = [bytes(h) for h in self.engine.block_manager.cached_hashes()]
        self.routers.send(CacheEvent(self.instance_id, cached, [], reset=True), links)

    def served_model_name(self) -> str:
        return self.config.served_model_name or Path(self.config.model).name

    def stop(self) -> None:
        self._running = False

    def _poll(self, timeout_ms: int) -> None:
        """Reads what came, then handles it. Only the reading holds the links' lock (the
        heartbeat thread sends on the same sockets): handling a message can take long (a
        structured request waits for the grammar compiler's tables in the first second or
        two after a start), and under the lock it stopped the heartbeats, so a router with
        ``--dead-after 1.5`` declared a busy, healthy worker dead (a CI failure)."""
        received = []
        with self.routers.lock:
            for sock, _ in self._poller.poll(timeout_ms):
                while True:
                    try:
                        received.append((sock, sock.recv_multipart(zmq.NOBLOCK, copy=False)))
                    except zmq.Again:
                        break
        for sock, frames in received:
            self._dispatch(sock, frames)

    def _dispatch(self, sock: zmq.Socket, frames: list[Any]) -> None:
        identity = frames[0].bytes if sock is self.peer else None
        body = frames[1] if sock is self.peer else frames[0]
        try:
            msg: Any = decode(body.buffer)
        except ProtocolError as e:
            logger.warning("%s: dropping a malformed message: %s", self.instance_id, e)
            return
        if sock is not self.peer:
            self.routers.heard(sock)
            if isinstance(msg, GenerateRequest):
                self.routers.origin[msg.request_id] = sock
                self.routers.attempts[msg.request_id] = msg.attempt
                self.routers.took(msg.origin, msg.seq)
            elif isinstance(msg, Abort) and not self.routers.is_current(
                msg.request_id, msg.attempt
            ):
                return  # aborts an older attempt; a newer one runs here now
            elif isinstance(msg, RegisterAck):
                self._on_register_ack(msg, sock)
                return
            elif isinstance(msg, RouterLeaving):
                aborted = self._abort_orphans_of(self.routers.left(sock))
                log = logger.warning if aborted else logger.info
                log(
                    "%s: router %s left; aborted %d request(s)",
                    self.instance_id,
                    msg.router_id,
                    aborted,
                )
                return
            self.on_router_message(msg)
        else:
            assert identity is not None
            self.on_peer_message(msg, identity)

    def on_router_message(self, msg: Any) -> None:
        if isinstance(msg, GenerateRequest):
            self.on_generate(msg)
        elif isinstance(msg, Abort):
            if msg.superseded and msg.request_id in self.request_ids():
                self.metrics.superseded_dropped.inc()
            self.on_abort(msg.request_id)
            self.routers.forget(msg.request_id)
        elif isinstance(msg, Drain):
            self.draining = True
        elif isinstance(msg, Undrain):
            self.draining = False
        elif isinstance(msg, LoRAUpdate):
            self._on_lora_update(msg)
        elif isinstance(msg, Shutdown):
            logger.info("%s: shutdown requested (%s)", self.instance_id, msg.reason)
            self.stop()
        else:
            logger.warning(
                "%s: unexpected %s from the router", self.instance_id, type(msg).__name__
            )

    def _on_lora_update(self, msg: LoRAUpdate) -> None:
        """Loads or drops a LoRA adapter between steps; every router learns the result."""
        error = ""
        try:
            if msg.unload:
                self.engine.remove_lora(msg.name)
            else:
                self.engine.add_lora(msg.name, msg.path)
        except (LoRAError, OSError, ValueError) as exc:  # a bad path or file: the caller's
            error = str(exc)
            logger.warning("%s: LoRA adapter %s: %s", self.instance_id, msg.name, error)
        state = LoRAState(self.instance_id, self.lora_identities(), msg.request_id, error)
        self.routers.send(state)

    def lora_identities(self) -> dict[str, bytes]:
        """The LoRA adapters loaded here, name -> identity (``Register.lora_adapters``)."""
        return {name: a.fingerprint for name, a in self.engine.loras.items()}

    def _on_register_ack(self, msg: RegisterAck, link: zmq.Socket) -> None:
        if msg.router_id:
            self.routers.set_router_id(msg.router_id, link)
        self.routers.set_takes_batches(link, msg.token_batches)
        if msg.known:
            self.registered = True
        else:
            logger.info(
                "%s: router does not know this instance; registering again", self.instance_id
            )
            self.register([link])

    def _abort_orphans(self) -> None:
        """Aborts the requests whose router went silent (killed, partitioned)."""
        now = time.monotonic()
        held = now - self._last_loop_tick
        self._last_loop_tick = now
        if held > self.config.heartbeat_interval:
            # the loop was held (a long step, or the process was paused): the routers' messages
            # wait unread, so judge them only after the next poll has read them (an Abort of a
            # superseded attempt, say, which tells a re-run apart from a dead router)
            self.routers.excuse(held)
            return
        if now - self._last_orphan_check < self.config.heartbeat_interval:
            return
        self._last_orphan_check = now
        silent = self.routers.silent_links(self.config.router_timeout)
        if silent and (aborted := self._abort_orphans_of(silent)):
            logger.warning(
                "%s: router silent for %.1f s; aborted %d request(s)",
                self.instance_id,
                self.config.router_timeout,
                aborted,
            )

    def _abort_orphans_of(self, silent: set[zmq.Socket]) -> int:
        """Aborts the requests whose router is on a ``silent`` link; returns how many."""
        orphans = [rid for rid in self.request_ids() if self.routers.is_orphan(rid, silent)]
        for request_id in orphans:
            self.on_abort(request_id)
            self.routers.forget(request_id)
        self.metrics.orphans_aborted.inc(len(orphans))
        return len(orphans)

    def request_ids(self) -> list[str]:
        """The requests this instance is working on (roles add what they hold)."""
        scheduler = self.engine.scheduler
        return [seq.seq_id for seq in [*scheduler.waiting, *scheduler.running]]

    def on_peer_message(self, msg: Any, identity: bytes) -> None:
        logger.warning("%s: unexpected %s from a peer", self.instance_id, type(msg).__name__)

    def on_generate(self, msg: GenerateRequest) -> None:
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                output_token_ids=msg.output_token_ids,
                pooling=msg.pooling,
            )
        except (RequestError, ValueError) as e:
            self.send_event(
                TokenEvent(
                    msg.request_id,
                    self.instance_id,
                    [],
                    len(msg.output_token_ids),
                    finished=True,
                    finish_reason="abort",
                    error=str(e),
                    error_param=getattr(e, "param", None),
                )
            )

    def on_abort(self, request_id: str) -> None:
        self.routers.origin.pop(request_id, None)
        self.engine.abort_request(request_id)

    def adopt_origin(self, request_id: str, router_id: str) -> None:
        """Events of ``request_id`` (handed over by a peer) go to router ``router_id`` only;
        to every router while that id is unknown."""
        self.routers.adopt_origin(request_id, router_id)

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.observe_step(time.perf_counter() - started, self.engine.last_step_kind)
        with self.routers.batch() if self.batch_events else contextlib.nullcontext():
            for out in outputs:
                self.on_output(out)
        self._collect_cache_changes()  # after the tokens went out

    def _collect_cache_changes(self) -> None:
        self._cache_feed.note(self.engine.flush_cache_events())

    def on_output(self, out: RequestOutput) -> None:
        self.send_event(token_event(self.instance_id, out))

    def housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_report >= self.config.heartbeat_interval:
            self._last_report = now
            self.routers.snapshot = self.load_report()  # the heartbeat thread sends it
            self._send_cache_events()
            self.metrics.update_load(self.engine)

    def _send_cache_events(self) -> None:
        """The device cache's changes since the last heartbeat, then the host pool's
        (the L1 keys this instance wrote or evicted, tagged with this host's id)."""
        self._collect_cache_changes()  # blocks also change between steps (KV intake, aborts)
        changes = self._cache_feed.take()
        if changes is not None:
            self.routers.send(CacheEvent(self.instance_id, *changes))
        if self.tiers is None:
            return
        host_id = self.info.host_id
        for name, changes in self.tiers.take_changes().items():
            tier = cast("CacheTier", name)  # only per-host tiers report (KvTier.take_changes)
            stored, evicted = changes
            event = CacheEvent(self.instance_id, stored, evicted, tier=tier, host_id=host_id)
            self.routers.send(event)

    def has_role_work(self) -> bool:
        return False

    def load_report(self) -> LoadReport:
        bm = self.engine.block_manager
        return LoadReport(
            instance_id=self.instance_id,
            num_waiting=self.engine.scheduler.num_waiting,
            num_running=self.engine.scheduler.num_running,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_pending_kv=self.num_pending_kv(),
            num_leaked_blocks=self.num_leaked_blocks(),
            draining=self.is_draining,
            num_prefill_tokens=self.engine.scheduler.num_prefill_tokens(),
            last_taken=dict(self.routers.last_taken),
        )

    def num_pending_kv(self) -> int:
        return 0

    # ------------------------------------------------------------------ sending
    def send_event(self, event: TokenEvent) -> None:
        """Sends to the router that sent the request (every router if it is unknown)."""
        self.routers.send_event(event)

    def send_peer(self, addr: str, msg: Any) -> None:
        """Sends to another worker's peer socket (one cached DEALER per address)."""
        self.peers.send(addr, msg)

    def reply_peer(self, identity: bytes, msg: Any) -> None:
        self.peers.reply(identity, msg)

    def close(self) -> None:
        self._running = False
        self.routers.join_heartbeat()
        self.status.close()
        self.routers.close(Leaving(self.instance_id))
        self.peers.close()
        self.close_role()
        self.kv_export.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.param_pool is not None:
            self.param_pool.close()
        self.security.stop(self.ctx)
        self.ctx.term()
        logger.info("%s stopped", self.instance_id)

    def close_role(self) -> None:
        pass
