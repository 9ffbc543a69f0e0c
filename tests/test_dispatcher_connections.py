"""The router's map of instance connections stays as large as the live fleet plus the dead
that requests in flight still watch: an autoscaled fleet's router does not keep one entry per
instance it ever saw."""

from __future__ import annotations

import asyncio

from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.messages import KvLayout, PeerInfo, Register, Role
from kvrelay.router.dispatcher import Dispatcher, DispatcherSettings
from kvrelay.router.tracked import Tracked
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.transport.curve import SocketSecurity

LAYOUT = KvLayout(
    num_layers=2, num_blocks=100, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32"
)


def _register(backend: Dispatcher, instance_id: str, role: Role) -> None:
    info = PeerInfo(instance_id, role, "host", "tcp://127.0.0.1:1", "", None, LAYOUT, b"fp")
    backend.membership.register(f"conn-{instance_id}".encode(), Register(info, "tiny", 128, 1))


def _watching(*instance_ids: str, done: bool = False) -> Tracked:
    tracked = Tracked(None, None, None, None, set(instance_ids))  # type: ignore[arg-type]
    tracked.done = done
    return tracked


def test_dead_instances_connections_go_once_no_request_watches_them(tiny_model_dir) -> None:
    async def scenario() -> None:
        tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
        security = SocketSecurity(ClusterCredential.generate())
        backend = Dispatcher(
            tokenizer, "tiny", 128, DispatcherSettings("tcp://127.0.0.1:1"), security
        )
        try:
            for n in range(4):
                _register(backend, f"p{n}", Role.PREFILL)
            _register(backend, "d0", Role.DECODE)
            assert set(backend.membership.connections) == {"p0", "p1", "p2", "p3", "d0"}
            assert backend.membership.prune(backend._watched) == 0  # all live
            for gone in ("p0", "p1", "p2"):
                backend.registry.remove(gone)  # as reap() does for the silent
            backend._tracked["r1"] = _watching("p1", "d0")  # in flight: p1's Aborts still matter
            backend._tracked["r2"] = _watching("p2", done=True)  # finished: p2's do not
            assert backend.membership.prune(backend._watched) == 2
            assert set(backend.membership.connections) == {"p1", "p3", "d0"}
            assert backend.membership.connections["p1"] == b"conn-p1"
            del backend._tracked["r1"]  # the request that watched p1 finished
            assert backend.membership.prune(backend._watched) == 1
            assert set(backend.membership.connections) == {"p3", "d0"}  # the live fleet
        finally:
            await backend.close()  # its socket, the CURVE authenticator's thread, the context

    asyncio.run(scenario())
