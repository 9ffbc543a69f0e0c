"""Engine throughput benchmark, values: the request set (random prompt ids, seeded), the
timing policy every timed run follows, and the typed results per system."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common import TimedRun, median, timed_quiet

MIN_TOKEN_ID = 3  # prompt ids are drawn from [3, vocab): 0..2 are make_tiny specials


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    prompt_lens: tuple[int, int]  # inclusive range
    output_lens: tuple[int, int]  # inclusive range
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class TimingPolicy:
    repeats: int = 1  # timed runs per system; the median counts
    max_others_cpu: float = 0.1  # time again while other processes used more of the CPUs
    attempts: int = 3  # runs at most per timed run, when other processes interfere
    max_wait_s: float = 300.0  # wait this long at most for quiet CPUs before each run

    def run(self, fn: Callable[[], Any], setup: Callable[[], object] | None = None) -> TimedRun:
        return timed_quiet(fn, setup, self.max_others_cpu, self.attempts, self.max_wait_s)


@dataclass(slots=True)
class SystemResult:
    name: str
    useful_tokens: int = 0  # output tokens the requests asked for
    computed_tokens: int = 0  # output tokens the system generated, waste included
    seconds: list[float] = field(default_factory=list)  # one per repeat
    others_cpu: list[float] = field(default_factory=list)  # CPU share others took, per repeat
    note: str = ""
    error: str | None = None  # set when the system did not run

    def add(self, run: TimedRun, useful_tokens: int) -> None:
        self.useful_tokens, self.computed_tokens = useful_tokens, run.value
        self.seconds.append(run.seconds)
        self.others_cpu.append(run.others_cpu)

    @property
    def tokens_per_s(self) -> float | None:
        if self.error is not None or not self.seconds:
            return None
        return self.useful_tokens / median(self.seconds)


@dataclass(frozen=True, slots=True)
class DecodeBound:
    step_s: float  # measured seconds per decode step at batch 1
    weight_bytes: int  # bytes of weights one decode step reads
    bandwidth: float  # measured copy bandwidth, bytes/s
    others_cpu: float  # largest CPU share other processes took while these were measured

    @property
    def bound_s(self) -> float:
        return self.weight_bytes / self.bandwidth


def make_requests(workload: Workload, vocab_size: int) -> list[Request]:
    rng = random.Random(workload.seed)
    requests = []
    for _ in range(workload.num_requests):
        prompt_len = rng.randint(*workload.prompt_lens)
        ids = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
        requests.append(Request(ids, rng.randint(*workload.output_lens)))
    return requests


def warmup_requests(vocab_size: int, num: int = 2) -> list[Request]:
    return make_requests(Workload(num, (16, 48), (4, 8), seed=12345), vocab_size)
