"""A worker's control-plane links: which router hears what, and the heartbeat that keeps it alive.

Decides where a worker's messages to the routers go. A worker holds one DEALER link per router
(``--control-addr`` may name several); a request's token events go to the router that sent it
(or to every router while that one is unknown), everything else to all of them. A thread of its
own sends the latest ``LoadReport`` every heartbeat interval, so a long engine step never looks
like death. Every router answers each report; ``silent_links`` names the routers not heard
from for a while (gone: their requests are orphans), and ``attempts`` stamps each request's
events with the router's attempt number.

Locking: ``lock`` guards the links; the worker's loop thread holds it while it polls them and
the heartbeat thread while it sends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from kvrelay.engine.outputs import RequestOutput
from kvrelay.protocol.messages import (
    LEAVING_LINGER_MS,
    Leaving,
    LoadReport,
    TokenEvent,
    TokenEvents,
    encode,
)
from kvrelay.transport.curve import SocketSecurity

logger = logging.getLogger(__name__)


class RouterLinks:
    """The DEALER links of one worker to its routers, the request -> router map, the heartbeat."""

    def __init__(
        self,
        ctx: zmq.Context,
        instance_id: str,
        router_addr: str,
        heartbeat_interval: float,
        security: SocketSecurity,
    ) -> None:
        self.instance_id = instance_id
        self._security = security
        # the routing id is this process's own: a router takes an instance's messages only
        # from the connection it registered from, so a second process under a live id is
        # refused, and the same process after a router restart is not
        self._routing_id = f"{instance_id}/{uuid.uuid4().hex[:8]}".encode()
        self.links = [self._connect(ctx, addr) for addr in router_addr.split(",")]
        self.lock = threading.RLock()  # router links: loop thread + heartbeat thread
        self.origin: dict[str, zmq.Socket] = {}  # request id -> the router that sent it
        self.by_router_id: dict[str, zmq.Socket] = {}  # router id (RegisterAck) -> its link
        # router id -> the seq of the last GenerateRequest taken in from it (LoadReport)
        self.last_taken: dict[str, int] = {}
        self.attempts: dict[str, int] = {}  # request id -> GenerateRequest.attempt
        self._last_heard = {link: time.monotonic() for link in self.links}  # loop thread only
        self._left: set[zmq.Socket] = set()  # links whose router said it left (loop thread)
        self.snapshot: LoadReport | None = None  # what the heartbeat thread sends
        self._heartbeat_interval = heartbeat_interval
        self._pending: list[TokenEvent] | None = None  # events of an open ``batch``
        self._batching: set[zmq.Socket] = set()  # links whose router takes TokenEvents
        self._is_running: Callable[[], bool] = lambda: False
        self._stopping = threading.Event()  # ends the heartbeat's wait at once (close)
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="heartbeat", daemon=True
        )

    def _connect(self, ctx: zmq.Context, addr: str) -> zmq.Socket:
        link = ctx.socket(zmq.DEALER)
        link.setsockopt(zmq.IDENTITY, self._routing_id)
        link.setsockopt(zmq.LINGER, 0)
        self._security.client(link)
        link.connect(addr.strip())
        return link

    def start_heartbeat(self, is_running: Callable[[], bool]) -> None:
        """Sends ``snapshot`` every interval from a thread of its own while ``is_running()``."""
        self._is_running = is_running
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        """Sends the latest load snapshot every interval, also while a long step runs."""
        while self._is_running():
            if self.snapshot is not None:
                self.send(self.snapshot)
            if self._stopping.wait(self._heartbeat_interval):
                return

    def set_router_id(self, router_id: str, link: zmq.Socket) -> None:
        """``link`` leads to router ``router_id`` (its RegisterAck); a router that had the
        link before (restarted at the same address, with a new id) is forgotten."""
        for old_id in [i for i, known in self.by_router_id.items() if known is link]:
            if old_id != router_id:
                del self.by_router_id[old_id]
                self.last_taken.pop(old_id, None)
        self.by_router_id[router_id] = link

    def took(self, router_id: str, seq: int) -> None:
        """A GenerateRequest of ``seq`` came from router ``router_id`` (loop thread)."""
        if seq:  # 0: an older router, which does not count
            self.last_taken[router_id] = seq

    def adopt_origin(self, request_id: str, router_id: str) -> None:
        """Events of ``request_id`` (handed over by a peer) go to router ``router_id`` only;
        to every router while that id is unknown."""
        link = self.by_router_id.get(router_id)
        if link is not None:
            self.origin[request_id] = link

    def heard(self, link: zmq.Socket) -> None:
        """A message came from the router on ``link`` (loop thread); one that had left is
        back (restarted at the same address)."""
        self._last_heard[link] = time.monotonic()
        self._left.discard(link)

    def left(self, link: zmq.Socket) -> set[zmq.Socket]:
        """The router on ``link`` said it exits (``RouterLeaving``); returns the links whose
        router left, that one included (loop thread)."""
        self._left.add(link)
        return set(self._left)

    def silent_links(self, timeout: float) -> set[zmq.Socket]:
        """The router links with nothing received for ``timeout`` seconds, and those whose
        router left."""
        since = time.monotonic() - timeout
        silent = {link for link, heard in self._last_heard.items() if heard < since}
        return silent | self._left

    def excuse(self, seconds: float) -> None:
        """The loop thread itself was held for ``seconds`` (a long step, the process paused):
        what the routers sent meanwhile waits unread, so their silence is not theirs."""
        for link in self._last_heard:
            self._last_heard[link] += seconds

    def is_orphan(self, request_id: str, silent: set[zmq.Socket]) -> bool:
        """The request's router is silent (every router, when its origin is unknown)."""
        origin = self.origin.get(request_id)
        return origin in silent if origin is not None else len(silent) == len(self.links)

    def is_current(self, request_id: str, attempt: int | None) -> bool:
        """An Abort of ``attempt`` applies to what runs (None: any attempt)."""
        return attempt is None or self.attempts.get(request_id, 0) <= attempt

    def send_event(self, event: TokenEvent) -> None:
        """Sends to the router that sent the request (every router if it is unknown); while
        ``batch`` is open the event waits for the batch's end."""
        if self._pending is not None:
            self._pending.append(event)
            return
        link, event = self._route(event)
        self.send(event, None if link is None else [link])

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Events sent inside go out at its end, one ``TokenEvents`` per router (a lone
        event as itself), each router's in the order they were sent (loop thread)."""
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            self.send_events(pending)

    def set_takes_batches(self, link: zmq.Socket, takes: bool) -> None:
        """Records what the router on ``link`` said in its last ``RegisterAck``."""
        if takes:
            self._batching.add(link)
        else:
            self._batching.discard(link)

    def send_events(self, events: list[TokenEvent]) -> None:
        """Each router's events as one ``TokenEvents`` where it takes them, else one by one."""
        by_link: dict[zmq.Socket, list[TokenEvent]] = {link: [] for link in self.links}
        for event in events:
            link, event = self._route(event)
            for target in self.links if link is None else [link]:
                by_link[target].append(event)
        for link, group in by_link.items():
            if len(group) > 1 and link in self._batching:
                self.send(TokenEvents(group), [link])
            else:
                for event in group:
                    self.send(event, [link])

    def _route(self, event: TokenEvent) -> tuple[zmq.Socket | None, TokenEvent]:
        """The event's router link (None: every router) and the event stamped with the
        request's attempt; a finished or handed-off request is forgotten."""
        origin = self.origin.get(event.request_id)
        attempt = self.attempts.get(event.request_id, 0)
        if event.finished or event.handed_off_to is not None:
            self.origin.pop(event.request_id, None)
            self.attempts.pop(event.request_id, None)
        if attempt != event.attempt:
            event = dataclasses.replace(event, attempt=attempt)
        return origin, event

    def forget(self, request_id: str) -> None:
        self.origin.pop(request_id, None)
        self.attempts.pop(request_id, None)

    def send(self, msg: Any, links: list[zmq.Socket] | None = None) -> None:
        """Sends ``msg`` on ``links`` (default: every router link); a full link drops it."""
        data = encode(msg)
        with self.lock:
            for link in self.links if links is None else links:
                try:
                    link.send(data, zmq.NOBLOCK)
                except zmq.Again:
                    logger.warning(
                        "%s: router link full; dropped %s", self.instance_id, type(msg).__name__
                    )

    def join_heartbeat(self) -> None:
        """Ends the heartbeat thread and waits for it (``is_running()`` is already false)."""
        self._stopping.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=2 * self._heartbeat_interval + 1)

    def close(self, leaving: Leaving | None = None) -> None:
        """Closes the links; ``leaving`` is sent first to the routers that have not left and
        given up to ``LEAVING_LINGER_MS`` to go out (the links' linger is 0 otherwise:
        nothing queued outlives the worker)."""
        staying = [link for link in self.links if link not in self._left]
        if leaving is not None and staying:
            self.send(leaving, staying)
        for link in self.links:
            link.close(LEAVING_LINGER_MS if leaving is not None and link in staying else 0)


def token_event(instance_id: str, out: RequestOutput, **extra: Any) -> TokenEvent:
    offset = len(out.token_ids) - len(out.new_token_ids)
    logprobs = None
    if out.logprobs and out.logprobs[-1] is not None:
        logprobs = [_logprob_wire(lp) for lp in out.logprobs[-len(out.new_token_ids) :]]
    if out.prompt_logprobs is not None and offset == 0:  # once, with the first token
        extra.setdefault("prompt_logprobs", [_logprob_wire(lp) for lp in out.prompt_logprobs])
    if out.embedding is not None:  # float32 little-endian, as the OpenAI API's base64
        extra.setdefault("embedding", out.embedding.numpy().astype("<f4").tobytes())
    return TokenEvent(
        request_id=out.request_id,
        instance_id=instance_id,
        token_ids=list(out.new_token_ids),
        offset=offset,
        logprobs=logprobs,
        finished=out.finished,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        num_cached_tokens=out.num_cached_tokens,
        cached_tokens_by_tier=out.cached_tokens_by_tier,
        **extra,
    )


def _logprob_wire(lp: Any) -> list[Any] | None:
    if lp is None:
        return None
    return [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]]


def new_request_id() -> str:
    return uuid.uuid4().hex
