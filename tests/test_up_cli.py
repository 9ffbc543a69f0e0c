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
