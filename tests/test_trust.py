"""The trust boundary, attacked with real processes: who may join, pull KV, or speak for whom.

A cluster (``kvrelay up``'s launcher: one prefill, one decode, tcp hand-off) holds a secret
of its own. Rogues connect raw ZMQ sockets to its control and peer ports the way an attacker
on the network would: without CURVE, with another cluster's secret, and with a key pair of
their own that knows the (public) server key. None of them is listed, receives a request,
gets KV, or changes a token, while the cluster keeps answering correctly. A process that
holds the real secret still cannot speak for another instance's request or take over a live
instance id. Without a secret ``serve`` refuses to start; ``--insecure-no-auth`` runs, open,
and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import zmq

from kvrelay.cli.launcher import Launcher, free_port
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.messages import (
    KV_HANDOFF_VERSION,
    KvData,
    KvLayout,
    KvPull,
    Leaving,
    LoadReport,
    PeerInfo,
    Register,
    RegisterAck,
    Role,
    TokenEvent,
    decode,
    encode,
)
from kvrelay.transport.curve import SocketSecurity
from tests.cluster_harness import metric_value, read_text, running_cluster

PROMPTS = [f"Request {i} crosses the trust boundary and" for i in range(6)]
ROGUES = ("no_credential", "another_secret", "own_key_pair")


@pytest.fixture(scope="module")
def launcher(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    log_dir = tmp_path_factory.mktemp("trust-logs")
    with running_cluster(tiny_model_dir, log_dir, transport="tcp") as launcher:
        yield launcher


@pytest.fixture(scope="module")
def expected(launcher: Launcher) -> dict[str, str]:
    """Each prompt's greedy completion, before any rogue connected."""
    return {p: complete(launcher, p) for p in PROMPTS}


def complete(launcher: Launcher, prompt: str, max_tokens: int = 12) -> str:
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)
    res = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return res.choices[0].text


def rogue_socket(ctx: zmq.Context, kind: str, launcher: Launcher, addr: str) -> zmq.Socket:
    """A DEALER connected to ``addr`` as an attacker of ``kind`` would connect it."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.routing_id = f"rogue-{kind}".encode()
    if kind == "another_secret":
        SocketSecurity(ClusterCredential.generate()).client(sock)
    elif kind == "own_key_pair":  # knows the server's public key, holds no secret
        assert launcher.credential is not None
        public, _ = launcher.credential.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = public
    elif kind == "member":
        SocketSecurity(launcher.credential).client(sock)
    sock.connect(addr)
    return sock


def peer_info(instance_id: str, role: Role = Role.COLOCATED) -> PeerInfo:
    return PeerInfo(
        instance_id=instance_id,
        role=role,
        host_id="rogue-host",
        peer_addr="tcp://127.0.0.1:9",
        status_url="http://127.0.0.1:9",
        kv_segment=None,
        layout=KvLayout(4, 4096, 16, 2, 32, "float32"),
        fingerprint=b"rogue",
        transport="tcp",
        kv_version=KV_HANDOFF_VERSION,
    )


def send(sock: zmq.Socket, msg: Any) -> None:
    """Sends without blocking: a rogue's socket never completes a handshake, and a DEALER
    with no connection would wait forever; its messages go nowhere, which is the point."""
    with contextlib.suppress(zmq.Again):
        sock.send(encode(msg), zmq.NOBLOCK)


def join_as(
    sock: zmq.Socket, instance_id: str, stop: threading.Event, pid: int = 4242, also: Any = None
) -> None:
    """Registers and heartbeats as an idle, roomy instance until ``stop``: the placement a
    router would prefer, if it listened; sends ``also`` with every heartbeat. The thread that
    runs this owns ``sock`` until it returns (ZMQ sockets are not thread-safe)."""
    send(sock, Register(peer_info(instance_id), "tiny", 4096, pid))
    while not stop.is_set():
        send(sock, LoadReport(instance_id, 0, 0, 4096, 4096))
        if also is not None:
            send(sock, also)
        time.sleep(0.1)


def received(sock: zmq.Socket, wait_ms: int = 300) -> list[Any]:
    out = []
    while sock.poll(wait_ms):
        out.append(decode(sock.recv()))
    return out


def instances(launcher: Launcher) -> dict[str, dict[str, Any]]:
    return {d["instance_id"]: d for d in launcher.get_json("/admin/instances")["data"]}


def router_metric(launcher: Launcher, name: str, **labels: str) -> float:
    return metric_value(read_text(launcher.url + "/metrics"), name, **labels)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ROGUES)
def test_rogue_on_the_control_port_gets_no_request_and_changes_no_token(
    launcher: Launcher, expected: dict[str, str], kind: str
) -> None:
    ctx = zmq.Context()
    rogue = rogue_socket(ctx, kind, launcher, launcher.control_addr)
    stop = threading.Event()
    forged = TokenEvent("cmpl-0-0", f"rogue-{kind}", [7], 0, finished=True)
    args = (rogue, f"rogue-{kind}", stop, 4242, forged)
    beat = threading.Thread(target=join_as, args=args, daemon=True)
    beat.start()
    try:
        time.sleep(1.0)  # a listening router would have placed the rogue by now
        for prompt in PROMPTS:
            assert complete(launcher, prompt) == expected[prompt]
        assert f"rogue-{kind}" not in instances(launcher)
    finally:
        stop.set()
        beat.join(5)
    try:
        assert received(rogue) == []  # no RegisterAck, no GenerateRequest
    finally:
        rogue.close()
        ctx.term()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [*ROGUES, "member"])
def test_only_a_member_reaches_a_workers_peer_port(launcher: Launcher, kind: str) -> None:
    """The same ``KvPull`` to the prefill worker's peer (KV) port: a member gets an answer
    (no such lease: refused), a rogue gets nothing at all, not even the refusal."""
    prefill = next(i for i in instances(launcher).values() if i["role"] == "prefill")
    ctx = zmq.Context()
    sock = rogue_socket(ctx, kind, launcher, prefill["peer_addr"])
    try:
        send(sock, KvPull("cmpl-guessed-0"))
        replies = []
        while sock.poll(2000):
            replies.append(sock.recv_multipart())
        if kind == "member":
            assert len(replies) == 1
            header = decode(replies[0][0], KvData)
            assert (header.request_id, header.ok) == ("cmpl-guessed-0", False)
        else:
            assert replies == []
    finally:
        sock.close()
        ctx.term()


@pytest.mark.timeout(180)
def test_a_member_cannot_speak_for_another_instances_request(
    launcher: Launcher, expected: dict[str, str]
) -> None:
    """With the real secret, an instance of its own: its events for a live request placed
    elsewhere, under its own id or the real decode's, are dropped; the stream stays right."""
    ids = instances(launcher)
    decode_id = next(i for i, d in ids.items() if d["role"] == "decode")
    ctx = zmq.Context()
    member = rogue_socket(ctx, "member", launcher, launcher.control_addr)
    stop = threading.Event()
    beat = threading.Thread(target=join_as, args=(member, "impostor", stop), daemon=True)
    beat.start()
    try:
        deadline = time.monotonic() + 10
        while "impostor" not in instances(launcher):  # it holds the secret: it may join
            assert time.monotonic() < deadline, "a member with the secret never joined"
            time.sleep(0.1)
        stop.set()  # silent now: it gets reaped, and no request is placed on it meanwhile
        beat.join(5)
        while "impostor" in instances(launcher):
            time.sleep(0.1)
        before = router_metric(
            launcher, "kvrelay_token_events_dropped_total", reason="not_assigned"
        )
        client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)
        prompt = PROMPTS[0]
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1000, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        first = next(chunks)
        request_id = f"{first.id}-0"
        for claimed in ("impostor", decode_id):  # its own id; the real decode's id
            forged = TokenEvent(request_id, claimed, [5] * 40, offset=1, finished=True)
            send(member, forged)
        text = first.choices[0].text + "".join(c.choices[0].text for c in chunks)
        after = router_metric(launcher, "kvrelay_token_events_dropped_total", reason="not_assigned")
        assert after - before == 2
        assert text == complete(launcher, prompt, max_tokens=1000)  # greedy: as if alone
    finally:
        stop.set()
        member.close()
        ctx.term()


@pytest.mark.timeout(120)
def test_a_register_under_a_live_id_is_refused_not_a_takeover(
    launcher: Launcher, expected: dict[str, str]
) -> None:
    before = instances(launcher)
    prefill_id = next(i for i, d in before.items() if d["role"] == "prefill")
    refused = router_metric(launcher, "kvrelay_control_messages_refused_total", reason="id_taken")
    ctx = zmq.Context()
    member = rogue_socket(ctx, "member", launcher, launcher.control_addr)
    stop = threading.Event()
    beat = threading.Thread(target=join_as, args=(member, prefill_id, stop, 999999), daemon=True)
    beat.start()
    try:
        send(member, Leaving(prefill_id))  # and no leave in its name either
        time.sleep(1.0)
        now = instances(launcher)[prefill_id]
        assert (now["pid"], now["peer_addr"]) == (
            before[prefill_id]["pid"],
            before[prefill_id]["peer_addr"],
        )
        assert all(complete(launcher, p) == expected[p] for p in PROMPTS[:3])
        stop.set()
        beat.join(5)
        acks = [m for m in received(member) if isinstance(m, RegisterAck) and m.known]
        assert acks == []
        after = router_metric(launcher, "kvrelay_control_messages_refused_total", reason="id_taken")
        assert after > refused
        assert (
            router_metric(
                launcher, "kvrelay_control_messages_refused_total", reason="foreign_connection"
            )
            > 0
        )  # its heartbeats under the live id were refused too
    finally:
        stop.set()
        beat.join(5)
        member.close()
        ctx.term()


def serve_router(model: Path, environ: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "kvrelay", "serve", "--role", "router", "--model", str(model),
        "--port", str(free_port()), "--control-addr", f"tcp://127.0.0.1:{free_port()}", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=environ, stderr=subprocess.PIPE, text=True)


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}


@pytest.mark.timeout(120)
def test_serve_without_a_secret_refuses_to_start(tiny_model_dir: Path) -> None:
    proc = serve_router(tiny_model_dir, clean_environ())
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "no cluster secret" in err and "kvrelay secret --out" in err
    assert "--insecure-no-auth" in err


@pytest.mark.timeout(120)
def test_serve_with_a_malformed_secret_names_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cluster.key"
    bad.write_text("not hex\n")
    proc = serve_router(tiny_model_dir, clean_environ(), "--cluster-secret-file", str(bad))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert str(bad) in err and "64 hex digits" in err


def test_secret_command_writes_a_private_file_once(tmp_path: Path) -> None:
    out = tmp_path / "keys" / "cluster.key"
    cmd = [sys.executable, "-m", "kvrelay", "secret", "--out", str(out)]
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    credential = ClusterCredential.from_file(out)  # 64 hex digits
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr  # never overwritten
    assert ClusterCredential.from_file(out).hex() == credential.hex()
    printed = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=60)
    assert len(bytes.fromhex(printed.stdout.strip())) == 32


@pytest.mark.timeout(180)
def test_insecure_no_auth_serves_open_and_warns(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_cluster(tiny_model_dir, tmp_path, insecure_no_auth=True) as launcher:
        assert complete(launcher, PROMPTS[0])
        ctx = zmq.Context()
        plain = rogue_socket(ctx, "no_credential", launcher, launcher.control_addr)
        try:  # open: a plain socket's heartbeat for an unknown id gets "register, please"
            plain.send(encode(LoadReport("stranger", 0, 0, 1, 1)))  # connected: it may block
            assert plain.poll(5000)
            assert decode(plain.recv(), RegisterAck).known is False
        finally:
            plain.close()
            ctx.term()
    router_log = (tmp_path / "router.log").read_text()
    assert "--insecure-no-auth" in router_log and "WARNING" in router_log
    assert "ANY connection" in router_log


def test_the_credential_never_shows_in_argv_or_repr(launcher: Launcher) -> None:
    assert launcher.credential is not None
    secret = launcher.credential.hex()
    for proc in launcher.procs.values():
        argv = " ".join(map(str, proc.popen.args))  # type: ignore[arg-type]
        assert secret not in argv, proc.name
    assert secret not in repr(launcher.credential)
    assert secret not in repr(dataclasses.replace(launcher.spec))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["serve", "fetch"])
def test_pool_transfer_without_a_secret_refuses_to_start(
    tiny_model_dir: Path, command: str
) -> None:
    where = (
        ["--bind", "tcp://127.0.0.1:0"] if command == "serve" else ["--from", "tcp://127.0.0.1:9"]
    )
    cmd = [sys.executable, "-m", "kvrelay", "pool", command, "--model", str(tiny_model_dir), *where]
    proc = subprocess.run(cmd, env=clean_environ(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no cluster secret" in proc.stderr


def test_up_takes_what_a_cluster_of_serve_processes_is_given() -> None:
    from kvrelay.cli import parse_args

    args = parse_args(
        [
            "up", "--model", "/m", "--cluster-id", "c1", "--redis-url", "redis://r:6379/0",
            "--admin-token", "t0k", "--cluster-secret-file", "/s/cluster.key",
        ],
        environ={},
    )  # fmt: skip
    assert (args.cluster_id, args.redis_url) == ("c1", "redis://r:6379/0")
    assert (args.admin_token, args.cluster_secret_file) == ("t0k", "/s/cluster.key")
