"""A worker's router links: a router is judged silent only for time the worker itself
listened; a step's token events go to each router as one message."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from kvrelay.protocol import messages
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.errors import ProtocolError
from kvrelay.protocol.messages import (
    WIRE_TYPES,
    KvLayout,
    PeerInfo,
    Register,
    RegisterAck,
    Role,
    TokenEvent,
    TokenEvents,
    decode,
    encode,
)
from kvrelay.router.dispatcher import Dispatcher, DispatcherSettings
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.transport.curve import SocketSecurity
from kvrelay.worker.router_links import RouterLinks
from kvrelay.worker.runtime import Worker


@pytest.fixture
def links() -> Iterator[RouterLinks]:
    ctx = zmq.Context()
    routers = RouterLinks(
        ctx, "w0", "tcp://127.0.0.1:9,tcp://127.0.0.1:10", 0.05, SocketSecurity(None)
    )
    yield routers
    for link in routers.links:
        link.close(0)
    ctx.term()


def test_silence_counts_from_the_last_message(links: RouterLinks) -> None:
    first, second = links.links
    time.sleep(0.2)
    links.heard(first)
    assert links.silent_links(0.1) == {second}
    links.origin["r1"] = second
    assert links.is_orphan("r1", {second}) and not links.is_orphan("r1", {first})


def test_a_held_loop_excuses_the_routers(links: RouterLinks) -> None:
    # the worker was paused (or ran a long step): what the routers sent meanwhile waits
    # unread, so neither counts as silent until the loop has had a chance to read it
    time.sleep(0.3)
    assert links.silent_links(0.1) == set(links.links)
    links.excuse(30.0)
    assert links.silent_links(0.1) == set()
    links.heard(links.links[0])  # a message read after the pause restarts the count as usual
    assert links.silent_links(0.1) == set()


def _two_routers() -> tuple[zmq.Context, list[zmq.Socket], RouterLinks]:
    """Two ROUTER sockets on loopback and a worker's links to both."""
    ctx = zmq.Context()
    routers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    ports = [r.bind_to_random_port("tcp://127.0.0.1") for r in routers]
    links = RouterLinks(
        ctx, "w0", ",".join(f"tcp://127.0.0.1:{p}" for p in ports), 0.05, SocketSecurity(None)
    )
    return ctx, routers, links


def test_a_batch_sends_one_message_per_router_in_order() -> None:
    """A step's events: one TokenEvents per router that takes them (its RegisterAck said so)
    with that router's events in order, one message an event to a router that does not (an
    older one), an event of unknown origin to every router, a lone event as itself; outside
    a batch each event goes at once."""
    ctx, routers, links = _two_routers()
    try:
        first, second = links.links
        links.set_takes_batches(first, True)
        links.set_takes_batches(second, False)  # an older router: no TokenEvents for it
        links.origin.update(r1=first, r2=second)
        links.attempts["r1"] = 2

        def event(request_id: str, offset: int, finished: bool = False) -> TokenEvent:
            return TokenEvent(request_id, "w0", [offset + 7], offset, finished=finished)

        with links.batch():
            links.send_event(event("r1", 0))
            links.send_event(event("r2", 0))
            links.send_event(event("r1", 1, finished=True))
            links.send_event(event("r3", 0))
            links.send_event(event("r2", 1))
            for router in routers:  # nothing leaves before the batch ends
                assert not router.poll(50)

        def received(router: zmq.Socket) -> list[object]:
            out = []
            while router.poll(2000 if not out else 200):
                out.append(decode(router.recv_multipart()[1]))
            return out

        stamped = [dataclasses.replace(event("r1", i, finished=i == 1), attempt=2) for i in (0, 1)]
        assert received(routers[0]) == [TokenEvents([*stamped, event("r3", 0)])]
        assert received(routers[1]) == [event("r2", 0), event("r3", 0), event("r2", 1)]
        assert "r1" not in links.origin and "r1" not in links.attempts  # finished: forgotten
        links.send_event(event("r2", 2))  # no batch: at once
        assert received(routers[1]) == [event("r2", 2)]
        with links.batch():  # a lone event as itself, also to a router that takes batches
            links.send_event(event("r4", 0))
        assert received(routers[0]) == [event("r4", 0)]
        assert received(routers[1]) == [event("r4", 0)]
    finally:
        links.close()
        for router in routers:
            router.close(0)
        ctx.term()


def test_token_events_round_trip_and_refuse_anything_else() -> None:
    batch = TokenEvents([TokenEvent("r1", "w0", [5], 0), TokenEvent("r2", "w0", [6], 3)])
    assert decode(encode(batch)) == batch
    tag = WIRE_TYPES.index(TokenEvents)
    bad = msgpack.ExtType(1, msgpack.packb([tag, [1, 2]], default=messages._default))
    with pytest.raises(ProtocolError, match="invalid TokenEvents"):
        decode(msgpack.packb(bad))


def test_routers_announce_batches_and_workers_follow_each_ack(tiny_model_dir) -> None:
    """The router's RegisterAck says it takes TokenEvents; a worker records it per link from
    every ack, and an older router's ack (without the field) decodes as not taking them."""

    async def router_ack() -> RegisterAck:
        tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
        security = SocketSecurity(ClusterCredential.generate())
        backend = Dispatcher(
            tokenizer, "tiny", 128, DispatcherSettings("tcp://127.0.0.1:1"), security
        )
        sent: list[RegisterAck] = []
        backend.membership._send_to = lambda identity, msg: sent.append(msg)
        try:
            layout = KvLayout(2, 100, 16, 2, 8, "float32")
            info = PeerInfo("d0", Role.DECODE, "host", "tcp://127.0.0.1:1", "", None, layout, b"f")
            backend.membership.register(b"conn-d0", Register(info, "tiny", 128, 1))
        finally:
            await backend.close()
        return sent[0]

    ack = asyncio.run(router_ack())
    assert ack.known and ack.token_batches
    fields = [getattr(ack, f.name) for f in dataclasses.fields(RegisterAck)][:3]
    old = msgpack.packb(msgpack.ExtType(1, msgpack.packb([WIRE_TYPES.index(RegisterAck), *fields])))
    assert decode(old) == dataclasses.replace(ack, token_batches=False)

    ctx = zmq.Context()
    links = RouterLinks(ctx, "d0", "tcp://127.0.0.1:9", 0.05, SocketSecurity(None))
    worker = types.SimpleNamespace(routers=links, registered=False, instance_id="d0")
    try:
        (link,) = links.links
        Worker._on_register_ack(worker, ack, link)  # type: ignore[arg-type]
        assert worker.registered and link in links._batching
        Worker._on_register_ack(worker, decode(old), link)  # the router was replaced by an older
        assert link not in links._batching
        # requests taken in are counted per router id; a router restarted on the same link
        # (a new id) replaces the old one in both maps, so neither grows with restarts
        links.took(ack.router_id, 3)
        links.took(ack.router_id, 0)  # an older router's request: no count
        links.took("router-elsewhere", 5)
        assert links.last_taken == {ack.router_id: 3, "router-elsewhere": 5}
        Worker._on_register_ack(worker, dataclasses.replace(ack, router_id="router-new"), link)
        assert links.by_router_id == {"router-new": link}
        assert links.last_taken == {"router-elsewhere": 5}
    finally:
        links.close()
        ctx.term()


def test_handling_a_message_leaves_the_heartbeat_free(links: RouterLinks) -> None:
    """The loop handles what it read without the links' lock, which the heartbeat thread
    needs to send: a message that takes long to handle (a structured request waiting for the
    grammar tables after a start) must not silence the worker for a router's --dead-after."""
    ctx = zmq.Context()
    ours, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ours.bind("inproc://handled")
    theirs.connect("inproc://handled")
    theirs.send(b"slow to handle")
    poller = zmq.Poller()
    poller.register(ours, zmq.POLLIN)
    heartbeat_could_send = []

    def dispatch(sock: zmq.Socket, frames: list) -> None:
        def heartbeat() -> None:
            took = links.lock.acquire(timeout=2.0)
            heartbeat_could_send.append(took)
            if took:
                links.lock.release()

        thread = threading.Thread(target=heartbeat)
        thread.start()
        thread.join()

    worker = types.SimpleNamespace(routers=links, _poller=poller, _dispatch=dispatch)
    try:
        Worker._poll(worker, 2000)  # type: ignore[arg-type]
    finally:
        ours.close(0)
        theirs.close(0)
        ctx.term()
    assert heartbeat_could_send == [True]


def test_a_router_that_left_is_silent_until_heard_again(links: RouterLinks) -> None:
    first, second = links.links
    links.heard(first)
    links.heard(second)
    assert links.silent_links(60.0) == set()
    assert links.left(first) == {first}  # at once, not after router_timeout
    assert links.silent_links(60.0) == {first}
    links.origin.update(r1=first, r2=second)
    assert links.is_orphan("r1", {first}) and not links.is_orphan("r2", {first})
    assert not links.is_orphan("unknown-origin", {first})  # the other router may have it
    links.heard(first)  # a router restarted at the same address
    assert links.silent_links(60.0) == set()


def test_leaving_goes_only_to_the_routers_still_there() -> None:
    ctx, routers, links = _two_routers()
    try:
        links.send(messages.LoadReport("w0", 0, 0, 0, 0))  # both connections are up
        for router in routers:
            assert router.poll(2000)
            router.recv_multipart()
        links.left(links.links[0])
        links.close(messages.Leaving("w0"))
        assert decode(routers[1].recv_multipart()[1]) == messages.Leaving("w0")
        assert not routers[0].poll(300)  # the router that left gets nothing
    finally:
        for router in routers:
            router.close(0)
        ctx.term()
