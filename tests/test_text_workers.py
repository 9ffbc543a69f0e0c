"""The router's tokenizer child process never outlives its router, however the router dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_ROUTER = """
import multiprocessing, sys, time
from kvrelay.router.text_workers import TextWorkers
from kvrelay.text.tokenizer import Tokenizer
workers = TextWorkers(Tokenizer.from_pretrained(sys.argv[1]), sys.argv[1])
workers.start()
workers._pool.submit(len, "x").result(timeout=60)  # the child runs
print(*[p.pid for p in multiprocessing.active_children() if "Process" in type(p).__name__],
      flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ")[1][0] != "Z"


def test_the_child_exits_when_its_router_is_killed(tiny_model_dir) -> None:
    router = subprocess.Popen(
        [sys.executable, "-c", _ROUTER, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = router.stdout.readline() if router.stdout else ""
        children = [int(pid) for pid in line.split()]
        assert children, "the pool started no child"
        assert all(_alive(pid) for pid in children)
    finally:
        router.send_signal(signal.SIGKILL)  # no shutdown of the pool: the worst case
        router.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, f"tokenizer child(ren) {children} outlived the router"
        time.sleep(0.2)
