"""A worker's router links judge a router silent only for time the worker itself listened."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvrelay.transport.curve import SocketSecurity
from kvrelay.worker.router_links import RouterLinks


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
