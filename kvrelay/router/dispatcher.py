"""The cluster backend: places requests on workers over ZMQ and streams their tokens back.

Per request the router keeps the tokens streamed so far and the instances it depends on::

    placed on (P, D)     watch {P, D}   P computes the prompt, D decodes after the hand-off
    first token (P)      watch {D}      the event says handed_off_to=D; P may now die freely
    a watched one dies   -> re-run on a surviving placement from the tokens already streamed
                            (GenerateRequest.output_token_ids) as the next attempt; the
                            client sees one stream; Abort(attempt) to the old instances too
                            (one that was only paused drops the superseded attempt on resume)
    client gone / stop   -> Abort to every watched instance (they free the blocks)

Every attempt has a number (GenerateRequest.attempt, echoed in TokenEvent.attempt); events of
an older attempt are dropped (``dropped_events{reason="superseded_attempt"}``) and their
sender is told to Abort it. Every LoadReport is answered with a RegisterAck: a worker that
hears nothing from a router for its ``router_timeout`` aborts that router's requests; the
router's ``close`` sends ``RouterLeaving`` to every instance it knows, which aborts them at once.

Liveness: an instance is dead after ``dead_after`` seconds without a message, or at once when
it sends ``Leaving`` as it exits; ``membership.Membership`` handles the instances' control
messages and the reaper, and calls back ``_on_gone``, which re-runs their requests.

Only the request's current placement speaks for it: an event from another instance, or from
a connection other than the one its instance registered from, is dropped (``not_assigned``);
DESIGN.md "Threat model" has the full table. What an admitted event streams (its order among
the others, stop strings, the text) is ``tracked.Tracked``'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from kvrelay.protocol.errors import ProtocolError
from kvrelay.protocol.messages import (
    LEAVING_LINGER_MS,
    Abort,
    GenerateRequest,
    RouterLeaving,
    TokenEvent,
    TokenEvents,
    decode,
    encode,
)
from kvrelay.protocol.sampling_params import REQUEST_NAMES
from kvrelay.router.admission import Admission
from kvrelay.router.backend import (
    Backend,
    BackendError,
    Delta,
    GenerateInput,
    GenerationFailed,
    InvalidRequest,
    Unavailable,
)
from kvrelay.router.instance import Instance, Placement
from kvrelay.router.lora_admin import LoRAAdmin
from kvrelay.router.membership import Membership
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.prefix_index import CacheIndex, PrefixMatch, reusable_block_keys
from kvrelay.router.registry import DEFAULT_PREFILL_QUEUE_LIMIT, Registry
from kvrelay.router.tracked import LatencySample, Tracked
from kvrelay.text.stop import StopChecker
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.transport.curve import SocketSecurity

logger = logging.getLogger(__name__)

_NUM_LATENCY_SAMPLES = 4096  # finished requests kept for windowed SLO attainment


@dataclasses.dataclass(frozen=True, slots=True)
class DispatcherSettings:
    control_addr: str  # ZMQ address the router binds for workers, e.g. tcp://127.0.0.1:5557
    dead_after: float = 2.0  # seconds without a load report before an instance is dead
    max_inflight: int = 1024  # requests on the workers at once; more wait (max_queue_time)
    max_queue_time: float = 0.0  # seconds a request may wait for a slot (0: 429 at once)
    max_retries: int = 3  # re-runs of one request after worker deaths
    retry_after: float = 1.0  # seconds suggested to clients on 429/503
    # placement: queued prefill tokens one cached prompt token is worth (1: compare in
    # prefill time; above 1 favours cache holders past that; 0: ignore the cache)
    cache_weight: float = 1.0
    # placement: prompt tokens queued on the chosen prefill instance from which its decode
    # instance may compute a prompt itself, when it would start it sooner (inf: never)
    prefill_queue_limit: float = DEFAULT_PREFILL_QUEUE_LIMIT

    def __post_init__(self) -> None:
        if not 0 <= self.cache_weight < math.inf:
            raise ValueError(f"cache_weight must be >= 0 and finite, got {self.cache_weight!r}")
        if not self.prefill_queue_limit >= 0:
            raise ValueError(
                f"prefill_queue_limit must be >= 0 (inf: never), got {self.prefill_queue_limit!r}"
            )


class Dispatcher(Backend):
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        settings: DispatcherSettings,
        security: SocketSecurity,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._max_model_len = max_model_len
        self.settings = settings
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"  # what requests carry as origin
        self.registry = Registry(
            settings.dead_after, settings.cache_weight, settings.prefill_queue_limit, self.router_id
        )
        self._is_stopping = False
        self.cache_index = CacheIndex()
        self.metrics = metrics or RouterMetrics()
        self.metrics.watch_registry(self.registry)
        self._ctx = zmq.asyncio.Context()
        self.security = security
        self._sock = self._ctx.socket(zmq.ROUTER)
        security.server(self._sock)  # only holders of the cluster secret get through
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._bound = False
        self._tracked: dict[str, Tracked] = {}
        self.admission = Admission(
            settings.max_inflight, settings.max_queue_time, settings.retry_after
        )
        self.lora_admin = LoRAAdmin(self.registry, self._send, (model_name,))  # runtime loads
        self.membership = Membership(
            self.registry,
            self.cache_index,
            self.lora_admin,
            self.metrics,
            self.router_id,
            self._send_to,
            self._on_gone,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._latencies: collections.deque[LatencySample] = collections.deque(
            maxlen=_NUM_LATENCY_SAMPLES
        )

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        lens = [i.max_model_len for i in self.registry.instances()]
        return min([self._max_model_len, *lens])

    def bind(self) -> None:
        """Binds the control address (once; ``start`` does it if nobody did before)."""
        if not self._bound:
            self._sock.bind(self.settings.control_addr)
            self._bound = True

    async def start(self) -> None:
        self.bind()
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="router-recv"),
            asyncio.create_task(
                self.membership.reap_loop(self.settings.dead_after, self._watched),
                name="router-reap",
            ),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # each worker drops this router's requests at once and skips its link when it leaves
        known = {inst.connection for inst in self.registry.instances()}
        for connection in known:
            self._send_to(connection, RouterLeaving(self.router_id))
        self._sock.close(LEAVING_LINGER_MS if known else 0)
        self.security.stop(self._ctx)
        self._ctx.term()

    def is_ready(self) -> bool:
        return not self.is_stopping and self.registry.is_ready()

    @property
    def is_stopping(self) -> bool:
        """Shutting down: not ready, new requests get 503, the ones in flight finish."""
        return self._is_stopping

    def stop_accepting(self) -> None:
        """Begins a graceful shutdown (SIGTERM): see ``is_stopping``."""
        self._is_stopping = True

    @property
    def num_inflight(self) -> int:
        return len(self._tracked)

    def num_requests_on(self, instance_id: str) -> int:
        """Requests in flight that still depend on an instance (placed on it, not handed off)."""
        return sum(1 for tr in self._tracked.values() if not tr.done and instance_id in tr.watch)

    def recent_latencies(self, window_s: float) -> list[LatencySample]:
        """The requests that finished in the last ``window_s`` seconds (at most 4096)."""
        since = time.monotonic() - window_s
        return [s for s in self._latencies if s.finished_at >= since]

    def lora_adapters(self) -> Sequence[str]:
        """The LoRA adapters live workers hold (``Registry.lora_adapters``)."""
        return tuple(self.registry.lora_adapters())

    # ------------------------------------------------------------------ requests
    async def generate(self, request: GenerateInput) -> AsyncIterator[Delta]:
        if self._is_stopping:
            raise Unavailable("this router is shutting down", self.settings.retry_after)
        if request.request_id in self._tracked:
            raise GenerationFailed(f"duplicate request id {request.request_id}")
        await self.admission.acquire(request.params.priority)
        try:
            # aclosing: a client gone closes the inner generator now (it aborts on the workers)
            async with contextlib.aclosing(self._generate(request)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self.admission.release()

    async def _generate(self, request: GenerateInput) -> AsyncGenerator[Delta, None]:
        placement = self._place(request)
        if placement is None:
            # (lora_name: no worker holds the adapter now, a 503 like no worker at all)
            unknown = self.registry.unknown_field(request.params.fields_set() - {"lora_name"})
            if unknown is not None:
                param = REQUEST_NAMES.get(unknown, unknown)
                raise InvalidRequest(
                    f"'{param}' is not supported by this cluster's workers: they run an"
                    " older kvrelay than the router (a rolling upgrade); retry without it, or"
                    " once they are upgraded",
                    param,
                )
            if request.pooling is not None and self.registry.is_ready():
                raise InvalidRequest(
                    "embeddings are not supported by this cluster's workers: they run an older"
                    " kvrelay than the router (a rolling upgrade)",
                    "input",
                )
            raise Unavailable("no worker instance is ready", self.settings.retry_after)
        if request.params.lora_name is not None:
            self.metrics.lora_requests.labels(request.params.lora_name).inc()
        if request.pooling is not None:
            self.metrics.embedding_inputs.inc()
            self.metrics.embedding_tokens.inc(len(request.prompt_token_ids))
        tr = Tracked(
            request,
            StopChecker(self.tokenizer, request.prompt_token_ids, request.params),
            asyncio.Queue(),
            placement,
            set(),
        )
        self._tracked[request.request_id] = tr
        self.metrics.inflight.inc()
        try:
            self._submit(tr, placement)
            while True:
                item = await tr.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    break
        finally:
            if not tr.done:
                self._abort(tr)
                self.metrics.observe_finish(tr.started, "abort")
            self._tracked.pop(request.request_id, None)
            self.metrics.inflight.dec()

    def _place(self, request: GenerateInput) -> Placement | None:
        """Cache-aware placement on workers that know the request's sampling fields; counts
        the chosen prefill instance's expected hits."""
        token_ids, params = request.prompt_token_ids, request.params
        lora = None
        if params.lora_name is not None:
            adapter = self.registry.lora_adapter(params.lora_name)
            if adapter is None:
                return None  # its workers left since the request was read
            lora = (params.lora_name, adapter)
        matched = self._matched(token_ids, params.cache_salt, None if lora is None else lora[1])
        placement = self.registry.place(
            matched=matched,
            num_prompt_tokens=len(token_ids),
            needs=params.fields_set(),
            lora=lora,
            pooled=request.pooling is not None,
        )
        if placement is not None:
            match = matched.get(placement.prefill.instance_id)
            if match is not None:
                self.metrics.observe_placement(match.device_blocks, match.host_blocks)
            if placement.local_prefill:
                self.metrics.local_prefills.inc()
        return placement

    def _matched(
        self, token_ids: list[int], cache_salt: str | None, adapter: bytes | None = None
    ) -> dict[str, PrefixMatch]:
        """Per instance, the prompt blocks in its device cache and its host's L1 pool (of
        requests with the same ``cache_salt`` and LoRA ``adapter``: both are in every
        block's key)."""
        first = self.registry.first_instance()
        if first is None:
            return {}
        info = first.info
        keys = reusable_block_keys(
            token_ids, info.layout.block_size, info.fingerprint, cache_salt, adapter
        )
        return self.cache_index.match(keys)

    def _submit(self, tr: Tracked, placement: Placement) -> None:
        tr.placement = placement
        tr.watch = {placement.prefill.instance_id}
        decode_info = None
        if placement.decode is not None:
            decode_info = placement.decode.info
            tr.watch.add(placement.decode.instance_id)
        seq = self.registry.assign(placement)
        worker_params = dataclasses.replace(tr.request.params, stop=(), n=1)
        msg = GenerateRequest(
            tr.request.request_id,
            tr.request.prompt_token_ids,
            worker_params,
            list(tr.tokens),
            decode_info,
            origin=self.router_id,
            attempt=tr.attempt,
            seq=seq,
            pooling=tr.request.pooling,
        )
        self._send(placement.prefill, msg)

    def _abort(self, tr: Tracked) -> None:
        tr.done = True
        for instance_id in tr.watch:
            inst = self.registry.get(instance_id)
            if inst is not None:
                self._send(inst, Abort(tr.request.request_id, tr.attempt))

    def _send(self, inst: Instance, msg: Any) -> None:
        self._send_to(inst.connection, msg)

    def _send_to(self, identity: bytes, msg: Any) -> None:
        """Sends without waiting; a failure (e.g. the peer left) is logged, not raised.

        The asyncio socket reports send errors through the returned future, not by raising.
        """
        what = f"{type(msg).__name__} to {identity.decode(errors='replace')}"
        try:
            sent = cast(  # zmq.asyncio returns an asyncio.Future
                "asyncio.Future[Any]",
                self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK),
            )
        except (zmq.Again, zmq.ZMQError) as e:
            logger.warning("cannot send %s: %s", what, e)
            return
        sent.add_done_callback(lambda f: _log_send_error(what, f))

    def drain(self, instance_id: str) -> bool:
        """Stops placing requests on an instance and tells it to drain; False if unknown."""
        return self.membership.set_draining(instance_id, True)

    def undrain(self, instance_id: str) -> bool:
        """Places requests on a drained instance again and tells it so; False if unknown."""
        return self.membership.set_draining(instance_id, False)

    # ------------------------------------------------------------------ events
    async def _recv_loop(self) -> None:
        while True:
            identity, body = await self._sock.recv_multipart()
            try:
                msg: Any = decode(body)
            except ProtocolError as e:
                logger.warning("dropping a malformed message from %r: %s", identity, e)
                continue
            self._on_message(identity, msg)

    def _on_message(self, identity: bytes, msg: Any) -> None:
        """One control message; ``identity`` is the connection it came on (an instance may
        speak only on the connection it registered from)."""
        if isinstance(msg, TokenEvent):
            self._on_tokens(identity, msg)
        elif isinstance(msg, TokenEvents):
            for event in msg.events:
                self._on_tokens(identity, event)
        else:
            self.membership.on_message(identity, msg)

    def _on_tokens(self, identity: bytes, event: TokenEvent) -> None:
        tr = self._tracked.get(event.request_id)
        if tr is None or tr.done:  # another router's, or a late event of a finished request
            reason = "unknown_request" if tr is None else "finished_request"
            self.metrics.dropped_events.labels(reason).inc()
            return
        if event.attempt != tr.attempt:  # an instance that missed the re-run (it was paused)
            self.metrics.dropped_events.labels("superseded_attempt").inc()
            is_its_own = self.membership.connection(event.instance_id) == identity
            if event.attempt < tr.attempt and not event.finished and is_its_own:
                abort = Abort(event.request_id, event.attempt, superseded=True)
                self._send_to(identity, abort)
            return
        if not self._is_assigned(tr, identity, event):
            self.metrics.dropped_events.labels("not_assigned").inc()
            logger.warning(
                "dropped a token event for %s from %s (%r): not assigned to it",
                event.request_id,
                event.instance_id,
                identity,
            )
            return
        if event.error is not None:
            tr.done = True
            error: BackendError = GenerationFailed(f"worker {event.instance_id}: {event.error}")
            if event.error_param is not None:
                error = InvalidRequest(event.error, event.error_param)
            tr.queue.put_nowait(error)
            return
        for delta in tr.accept(event, self.metrics):
            if delta.finished:
                if tr.stopped_by_string:
                    self._abort(tr)  # the worker is still generating
                self.metrics.observe_finish(tr.started, delta.finish_reason or "stop")
                if (sample := tr.latency()) is not None:
                    self._latencies.append(sample)
            tr.queue.put_nowait(delta)

    def _is_assigned(self, tr: Tracked, identity: bytes, event: TokenEvent) -> bool:
        """True when the event comes, on its own connection, from an instance of the
        request's current placement, and hands off (if it does) within that placement."""
        assigned = {i.instance_id for i in tr.placement.instances}
        if event.instance_id not in assigned:
            return False
        if event.handed_off_to is not None and event.handed_off_to not in assigned:
            return False
        return self.registry.get_from(event.instance_id, identity) is not None

    # ------------------------------------------------------------------ failures
    def _watched(self) -> set[str]:
        """The instances that requests in flight still depend on."""
        return set().union(*(tr.watch for tr in self._tracked.values() if not tr.done))

    def _on_gone(self, gone: set[str], how: str) -> None:
        """Instances out of the registry (silent past ``dead_after``, or ``Leaving``): their
        cached prefixes and adapters are forgotten, and requests they had are re-run."""
        self.membership.forget(gone)
        retried = [tr for tr in self._tracked.values() if not tr.done and tr.watch & gone]
        log = logger.warning if how != "left" or retried else logger.info
        log("instances %s: %s", how, ", ".join(sorted(gone)))
        for tr in retried:
            self._retry(tr, gone)

    def _retry(self, tr: Tracked, dead: set[str]) -> None:
        # the dead too: one that was only paused finds the Abort when it resumes
        abort = Abort(tr.request.request_id, tr.attempt, superseded=True)
        for instance_id in tr.watch:
            connection = self.membership.connection(instance_id)
            if connection is not None:
                self._send_to(connection, abort)
        tr.early.clear()
        placement = self._place(tr.request)
        if placement is None or tr.num_retries >= self.settings.max_retries:
            tr.done = True
            why = "no worker instance left" if placement is None else "too many retries"
            tr.queue.put_nowait(GenerationFailed(f"generation broke off ({why})"))
            return
        tr.num_retries += 1
        tr.attempt += 1
        self.metrics.retries.inc()
        logger.warning(
            "re-running %s on %s after %d tokens",
            tr.request.request_id,
            "+".join(i.instance_id for i in placement.instances),
            len(tr.tokens),
        )
        self._submit(tr, placement)


def _log_send_error(what: str, sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.warning("cannot send %s: %s", what, sent.exception())
