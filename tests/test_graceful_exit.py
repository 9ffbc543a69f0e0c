"""SIGTERM with real processes: a worker or a router drains, then exits 0.

A decode worker terminated mid-stream finishes the stream itself (no retry elsewhere, the
same greedy text as the offline engine) and exits 0, telling the routers it leaves (they drop
it at once, not after --dead-after of silence).
A router terminated mid-stream (another router beside it) answers new requests with 503,
finishes the stream, and exits 0; the other router serves on. Afterwards the harness's leak
checks run on the surviving workers and no shared-memory segment remains.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import openai

from kvrelay.cli.launcher import Launcher
from tests.cluster_harness import (
    STREAM_PROMPT,
    STREAM_TOKENS,
    decode_running,
    metric_value,
    read_text,
    running_cluster,
    worker_stats,
)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _stream(c: openai.OpenAI, max_tokens: int = STREAM_TOKENS):
    return c.completions.create(
        model="tiny",
        prompt=STREAM_PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
    )


def _terminate(launcher: Launcher, name: str) -> object:
    """Sends SIGTERM to process ``name`` without waiting; the launcher forgets it."""
    proc = launcher.procs.pop(name)
    proc.popen.send_signal(signal.SIGTERM)
    return proc


def _wait_exit(proc: object) -> int:
    code = proc.popen.wait(timeout=60)  # type: ignore[attr-defined]
    if proc.log:  # type: ignore[attr-defined]
        proc.log.close()  # type: ignore[attr-defined]
    return int(code)


def _wait_gone(launcher: Launcher, instance_id: str, timeout: float = 30.0) -> None:
    """Waits until the router no longer lists ``instance_id`` (its heartbeats stopped)."""
    deadline = time.monotonic() + timeout
    while instance_id in (launcher.joined_instances() or {instance_id}):
        assert time.monotonic() < deadline, f"the router still lists {instance_id}"
        time.sleep(0.1)


def test_sigterm_drains_a_decode_worker_mid_stream(tiny_model_dir, tmp_path, stream_reference):
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=1, num_decode=2) as launcher:
        parts, victim, proc = [], None, None
        for chunk in _stream(_client(launcher.url)):
            parts.append(chunk.choices[0].text)
            if victim is None and len(parts) == 5:
                victim = decode_running(launcher)
                proc = _terminate(launcher, victim)
        assert victim is not None
        assert "".join(parts) == stream_reference
        assert _wait_exit(proc) == 0
        log = (tmp_path / f"{victim}.log").read_text()
        assert "drained; exiting" in log
        metrics = read_text(launcher.url + "/metrics")
        assert metric_value(metrics, "kvrelay_request_retries_total") == 0  # it finished there
        _wait_gone(launcher, victim)
        # it said it was leaving: out at once, not after --dead-after of silence. Read from
        # its last join: a worker starting at nice 19 on a loaded machine can miss the tests'
        # 1.5 s --dead-after once before it serves, and registers again (seen in CI)
        router_log = (tmp_path / "router.log").read_text()
        since_join = router_log[router_log.rindex(f"instance {victim} (decode) joined") :]
        assert f"instances left: {victim}" in since_join
        assert "gone silent" not in since_join
        again = "".join(c.choices[0].text for c in _stream(_client(launcher.url), 16))
        assert again == stream_reference[: len(again)] and again


def test_sigterm_lets_a_router_finish_its_stream(tiny_model_dir, tmp_path, stream_reference):
    with running_cluster(tiny_model_dir, tmp_path, num_routers=2) as launcher:
        second = launcher.router_urls[1]
        parts, proc, refused = [], None, None
        for chunk in _stream(_client(second)):
            parts.append(chunk.choices[0].text)
            if proc is None and len(parts) == 5:
                proc = _terminate(launcher, "router-1")
                refused = _new_request_on(second)
        assert "".join(parts) == stream_reference
        assert _wait_exit(proc) == 0
        assert refused in ("503 shutting down", "refused"), refused
        log = (tmp_path / "router-1.log").read_text()
        assert "finishing 1 request(s) in flight" in log
        again = "".join(c.choices[0].text for c in _stream(_client(launcher.url), 16))
        assert again == stream_reference[: len(again)] and again


def _new_request_on(url: str) -> str:
    """What a new request to a terminated router meets: 503 while it drains, a refused
    connection once it has gone (the stream may finish first on a fast machine)."""
    try:
        _client(url).completions.create(model="tiny", prompt=STREAM_PROMPT, max_tokens=4)
    except openai.APIStatusError as e:
        if e.status_code == 503 and "shutting down" in str(e.message):
            return "503 shutting down"
        return f"{e.status_code} {e.message}"
    except openai.APIConnectionError:
        return "refused"
    return "served"


def test_a_router_that_exits_tells_its_workers(tiny_model_dir, tmp_path, stream_reference):
    """A router that exits with a stream still running (``--drain-timeout 0``) aborts it and
    says it leaves: every worker logs it at once (its silence alone would take the workers'
    ``router_timeout``, ``--dead-after``: 30 s here), and the stream's request is gone from
    the workers (by the router's Abort, or by ``RouterLeaving`` where that did not come)."""
    router_args = ("--dead-after", "30", "--served-model-name", "tiny", "--drain-timeout", "0")
    with running_cluster(
        tiny_model_dir, tmp_path, num_routers=2, num_prefill=0, num_decode=0, num_colocated=1,
        router_args=router_args,
    ) as launcher:  # fmt: skip
        proc, parts = None, 0
        try:
            for _ in _stream(_client(launcher.router_urls[1]), max_tokens=3000):
                parts += 1
                if proc is None and parts == 5:
                    proc = _terminate(launcher, "router-1")
        except (openai.APIError, httpx.HTTPError):
            pass  # the router went with the stream open
        assert proc is not None and parts < 3000
        assert _wait_exit(proc) == 0
        workers = [name for name in launcher.procs if not name.startswith("router")]
        deadline = time.monotonic() + 20  # well inside the 30 s of silence
        left: list[tuple[str, str]] = []
        while len(left) < len(workers):
            assert time.monotonic() < deadline, left
            left = [m for name in workers for m in LEFT.findall(read_log(tmp_path, name))]
            time.sleep(0.1)
        assert len({router for router, _ in left}) == 1, left  # the same router, once each
        assert all(s["num_running"] == 0 for s in worker_stats(launcher).values())
        again = "".join(c.choices[0].text for c in _stream(_client(launcher.url), 16))
        assert again == stream_reference[: len(again)] and again


LEFT = re.compile(r"router (router-\w+) left; aborted (\d+) request")


def read_log(log_dir, name: str) -> str:
    return (log_dir / f"{name}.log").read_text()
