"""`kvrelay up` as a new user meets it: errors name what is wrong before anything starts."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def _up(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", "up", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_a_missing_model_directory_is_named(tmp_path) -> None:
    missing = tmp_path / "nonexistent"
    out = _up("--model", str(missing))
    assert out.returncode != 0
    assert f"model directory {missing} does not exist" in out.stderr
    assert "None" not in out.stderr and "serving" not in out.stdout


def test_a_directory_without_a_checkpoint_is_named(tmp_path) -> None:
    out = _up("--model", str(tmp_path))
    assert out.returncode != 0
    assert "not a checkpoint directory (no config.json)" in out.stderr


def test_a_taken_port_fails_before_anything_claims_to_serve(tiny_model_dir) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _up("--model", str(tiny_model_dir), "--port", str(port))
    assert out.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in out.stderr
    assert "serving" not in out.stdout


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["up", "--model", "m", "--no-such-flag"], "usage: kvrelay up"),
        (["pool", "ls", "--no-such-flag"], "usage: kvrelay pool ls"),
    ],
)
def test_a_bad_flag_shows_the_usage_of_the_command_typed(argv: list[str], usage: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay", *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert usage in out.stderr
    assert "unrecognized arguments: --no-such-flag" in out.stderr


def test_port_check_refuses_a_listener_but_not_closing_connections() -> None:
    """A live server on the port is refused; the connections a stopped cluster leaves in
    TIME_WAIT (up to a minute) are not: the router binds with SO_REUSEADDR, as uvicorn does,
    so a `kvrelay up` restarted right after a stop must start."""
    from kvrelay.cli.launcher import LaunchError, check_port_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is in use"):
        check_port_free("127.0.0.1", port)
    accepted.close()  # the server's side closes first: its end of the port waits in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    check_port_free("127.0.0.1", port)


@pytest.mark.parametrize("taken", ["http", "control"])
def test_a_port_taken_after_the_pick_starts_the_cluster_on_others(
    tiny_model_dir, tmp_path, taken: str
) -> None:
    """A port the launcher picked was free when picked; another process can bind it before the
    router does (CI saw a router exit so). The router exits with EXIT_ADDRESS_IN_USE, naming
    what is taken, and the launcher starts everything again on other ports."""
    from kvrelay.cli.launcher import ClusterSpec, Launcher

    spec = ClusterSpec(
        model=str(tiny_model_dir),
        num_prefill=0,
        num_decode=0,
        num_colocated=1,
        worker_args=("--num-blocks", "64", "--threads", "1"),
        log_dir=str(tmp_path),
    )
    launcher = Launcher(spec)
    picked = (launcher.port, launcher.control_addr)
    port = launcher.port if taken == "http" else int(launcher.control_addr.rsplit(":", 1)[1])
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        try:
            launcher.start(timeout=120)
            assert (launcher.port, launcher.control_addr) != picked
            assert port not in (launcher.port, int(launcher.control_addr.rsplit(":", 1)[1]))
            models = launcher.get_json("/v1/models", timeout=10)
            assert [m["id"] for m in models["data"]] == [tiny_model_dir.name]
            assert launcher.joined_instances() == {"colocated-0"}
        finally:
            launcher.stop()
    log = (tmp_path / "router.log").read_text()
    assert "router: cannot start: " in log and f":{port}" in log
    assert "Address already in use" in log or "Address in use" in log
    assert log.count("router: serving") == 1  # the second start's


@pytest.mark.timeout(180)
def test_ctrl_c_during_a_stream_leaves_no_process_and_no_shared_memory(
    tiny_model_dir, tmp_path
) -> None:
    """Ctrl-C in a terminal sends SIGINT to `kvrelay up`'s process group (the router and the
    workers run in sessions of their own: the launcher stops them), here while a request
    streams: everything exits and none of the cluster's shared-memory segments (KV pools,
    the host pool and its lock) remains."""
    import json
    import os
    import signal
    import threading
    import time
    import urllib.request
    from pathlib import Path

    from kvrelay.cli.launcher import free_port

    port = free_port()
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", "up", "--model", str(tiny_model_dir), "--port",
         str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    streamed, model = threading.Event(), []

    def stream() -> None:
        body = {"model": model[0], "prompt": "hello " * 40, "max_tokens": 500, "stream": True}
        body["ignore_eos"] = True
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                for line in resp:
                    if line.startswith(b"data: {"):
                        streamed.set()
        except OSError:
            pass  # the cluster went away mid-stream, as intended

    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(url + "/ready", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "kvrelay up did not get ready"
                time.sleep(0.3)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            model.append(json.load(resp)["data"][0]["id"])
        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert streamed.wait(60), "no token streamed"
        children = _children(up.pid)
        assert len(children) >= 3  # the router, a prefill and a decode worker
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C does
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:  # a failed check: the launcher stops its cluster on SIGINT
            os.kill(up.pid, signal.SIGINT)  # (its processes run in sessions of their own:
            try:  # a SIGKILL here would leave them running)
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        log.close()
    time.sleep(0.5)
    for pid in children:  # the launcher waited for each: none is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    left = [p.name for p in Path("/dev/shm").iterdir() if f"up{up.pid}-" in p.name]
    assert left == [], left


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(180)
def test_kvrelay_up_killed_with_sigkill_leaves_no_process_and_no_shared_memory(
    tiny_model_dir, tmp_path
) -> None:
    """SIGKILL cannot be caught, so `kvrelay up` cannot stop its cluster: the router and the
    workers (in sessions of their own) notice that their launcher is gone, drain and exit on
    their own, and unlink the cluster's shared memory."""
    import os
    import signal
    import time
    import urllib.request
    from pathlib import Path

    from kvrelay.cli.launcher import free_port

    port = free_port()
    with (tmp_path / "up.log").open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "up", "--model", str(tiny_model_dir), "--port",
             str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "KVRELAY_DRAIN_TIMEOUT": "5"},  # the processes' drains
        )  # fmt: skip
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "kvrelay up did not get ready"
                time.sleep(0.3)
        children = _children(up.pid)
        assert len(children) >= 3  # the router, a prefill and a decode worker
        assert [p.name for p in Path("/dev/shm").iterdir() if f"up{up.pid}-" in p.name]
        up.kill()
        up.wait(30)
        deadline = time.monotonic() + 90  # a drain of at most 5 s, then the exit
        while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in children if _alive(pid)]
        assert left == [], f"still running after their launcher was killed: {left}"
        segments = [p.name for p in Path("/dev/shm").iterdir() if f"up{up.pid}-" in p.name]
        assert segments == [], segments
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in children:  # a failed check: end what is left
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie (an orphan's zombie is reaped by init at once)."""
    from pathlib import Path

    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(180)
def test_ctrl_c_while_starting_stops_at_once(tiny_model_dir, tmp_path) -> None:
    """A signal before the workers have joined ends the start there (it does not wait for
    every worker to be ready first): nothing claims to serve, it exits 0, and no process or
    shared-memory segment of the cluster is left."""
    import os
    import signal
    import time
    from pathlib import Path

    log_dir = tmp_path / "logs"
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", "up", "--model", str(tiny_model_dir), "--log-dir",
         str(log_dir)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(children := _children(up.pid)) < 3:  # the router and both workers started
            assert up.poll() is None and time.monotonic() < deadline, children
            time.sleep(0.05)
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGINT)
            up.wait(60)
        log.close()
    out = (tmp_path / "up.log").read_text()
    assert "a signal came before every process was ready" in out, out[-2000:]
    assert "kvrelay: serving" not in out
    for name in ("prefill-0", "decode-0"):  # still loading when the signal came
        assert f"{name} ready:" not in (log_dir / f"{name}.log").read_text()
    time.sleep(0.5)
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    left = [p.name for p in Path("/dev/shm").iterdir() if f"up{up.pid}-" in p.name]
    assert left == [], left
