"""``kvrelay bench``: the load generator end to end against a real 1P+1D cluster (tiny model),
and its workload and aggregation math on hand-made values."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench import (
    BenchError,
    LoadConfig,
    RequestRecord,
    Slo,
    check_server,
    make_requests,
    percentile,
    summarize,
    warm_up_config,
)
from kvrelay.cli.bench import length_range
from tests.cluster_harness import running_cluster

SERVED = "tiny"  # running_cluster's served model name
NUM_REQUESTS = 6


def run_bench_cli(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "kvrelay", "bench",
        "--url", url, "--model", SERVED,
        "--rate", "5", "--num-requests", str(NUM_REQUESTS),
        "--prompt-len", "8:32", "--output-len", "4:8", "--seed", "3",
        "--slo-ttft-ms", "30000", "--slo-tpot-ms", "30000",
        "--json", str(out), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(180)
def test_bench_cli_against_1p1d(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_cluster(tiny_model_dir, tmp_path / "logs") as launcher:
        out = tmp_path / "bench.json"
        proc = run_bench_cli(launcher.url, out)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "TTFT (ms)" in proc.stdout and "goodput" in proc.stdout
        assert "req/s" in proc.stderr  # the progress bar
        data = json.loads(out.read_text())
        assert data["num_requests"] == data["num_completed"] == NUM_REQUESTS
        assert data["num_failed"] == 0 and data["errors"] == {}
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            stats = data[name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
        assert data["request_throughput"] > 0 and data["output_throughput"] > 0
        assert data["goodput"] == data["request_throughput"]  # SLOs generous enough for all
        assert data["slo_attainment"] == 1.0
        requests = data["requests"]
        assert [r["index"] for r in requests] == list(range(NUM_REQUESTS))
        assert all(r["output_tokens"] == r["output_len"] for r in requests)  # eos ignored
        assert all(8 <= r["prompt_len"] <= 32 and 4 <= r["output_len"] <= 8 for r in requests)
        assert data["total_output_tokens"] == sum(r["output_len"] for r in requests)

        # Prompt ids outside the vocabulary: every request fails with a 400, and is counted.
        bad = tmp_path / "bad.json"
        proc = run_bench_cli(launcher.url, bad, "--vocab-size", "1000000", "--num-warmup", "0")
        assert proc.returncode == 1, proc.stderr[-4000:]
        data = json.loads(bad.read_text())
        assert data["num_failed"] == NUM_REQUESTS and data["num_completed"] == 0
        assert data["ttft_ms"] is None and data["goodput"] == 0
        assert sum(data["errors"].values()) == NUM_REQUESTS
        assert all(m.startswith("HTTP 400") and "vocabulary" in m for m in data["errors"])

        with pytest.raises(BenchError, match="'nope' is not served"):
            check_server(LoadConfig(launcher.url, "nope"))
        with pytest.raises(BenchError, match="max_model_len"):
            check_server(LoadConfig(launcher.url, SERVED, prompt_lens=(8, 1 << 20)))


def record(index: int, ttft_ms: float, e2e_ms: float, output_tokens: int) -> RequestRecord:
    return RequestRecord(
        index,
        prompt_len=10,
        output_len=output_tokens,
        output_tokens=output_tokens,
        ttft_s=ttft_ms / 1e3,
        e2e_s=e2e_ms / 1e3,
    )


def test_summarize_percentiles_and_goodput() -> None:
    records = [
        record(0, 100, 1100, 11),  # TPOT 100 ms
        record(1, 200, 700, 11),  # TPOT 50
        record(2, 300, 500, 5),  # TPOT 50
        record(3, 400, 420, 2),  # TPOT 20: misses the TTFT SLO
        record(4, 500, 500, 1),  # one token: TPOT 0, misses the TTFT SLO
        RequestRecord(5, 10, 8, error="HTTP 500: boom"),
        RequestRecord(6, 10, 8, error="HTTP 500: boom"),
    ]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=350, tpot_ms=60))
    assert (s.num_requests, s.num_completed, s.num_failed) == (7, 5, 2)
    assert s.errors == {"HTTP 500: boom": 2}
    assert s.ttft_ms is not None and s.tpot_ms is not None and s.e2e_ms is not None
    assert s.ttft_ms.mean == pytest.approx(300)
    assert s.ttft_ms.p50 == pytest.approx(300)
    assert s.ttft_ms.p90 == pytest.approx(460)  # between 400 and 500, 60% of the way
    assert s.ttft_ms.p99 == pytest.approx(496)
    assert s.tpot_ms.p50 == pytest.approx(50) and s.tpot_ms.mean == pytest.approx(44)
    assert s.tpot_ms.p99 == pytest.approx(98)  # 50 + 0.96 * (100 - 50)
    assert s.e2e_ms.p50 == pytest.approx(500)
    # Good: records 1 and 2 (record 0's TPOT is 100 > 60; 3 and 4 are late).
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.slo_attainment == pytest.approx(2 / 7)
    assert s.request_throughput == pytest.approx(5 / 2.0)
    assert s.total_output_tokens == 11 + 11 + 5 + 2 + 1
    assert s.output_throughput == pytest.approx(30 / 2.0)
    assert s.total_input_tokens == 50


def test_summarize_nothing_completed() -> None:
    s = summarize([RequestRecord(0, 4, 4, error="x")], duration_s=1.0, slo=Slo(1, 1))
    assert s.num_completed == 0 and s.ttft_ms is None and s.goodput == 0
    assert s.slo_attainment == 0


def test_percentile() -> None:
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_make_requests_poisson_and_seeded() -> None:
    config = LoadConfig("http://x", "m", rate=4.0, num_requests=4000, prompt_lens=(3, 9),
                        output_lens=(2, 5), seed=11, vocab_size=50)  # fmt: skip
    requests = make_requests(config)
    assert requests == make_requests(config)
    assert requests != make_requests(dataclasses.replace(config, seed=12))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.06)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.1)  # exponential: std == mean
    assert {len(r.prompt_ids) for r in requests} == set(range(3, 10))
    assert {r.output_len for r in requests} == {2, 3, 4, 5}
    assert {t for r in requests for t in r.prompt_ids} == set(range(4, 50))

    burst = make_requests(LoadConfig("http://x", "m", rate=math.inf, num_requests=5))
    assert [r.arrival_s for r in burst] == [0.0] * 5


def test_warm_ups_go_one_after_another_not_at_the_rate() -> None:
    """``--num-warmup``'s requests: each sent when the last finished (one at a time, no gaps
    drawn), whatever the timed load's rate (a 0.2/s load once waited ~5 s per warm-up)."""
    timed = LoadConfig("http://x", "m", rate=0.2, num_requests=100, seed=5)
    warm = warm_up_config(timed, 3)
    assert warm.concurrency_limit == 1 and warm.num_requests == 3
    assert [r.arrival_s for r in make_requests(warm)] == [0.0] * 3
    assert {r.output_len for r in make_requests(warm)} <= set(range(4, 9))


def test_config_and_ranges_reject_bad_values() -> None:
    assert length_range("32:1024") == (32, 1024) and length_range("64") == (64, 64)
    for text in ("0:5", "9:3", "a:b", "3:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="LOW"):
            length_range(text)
    with pytest.raises(ValueError, match="rate"):
        LoadConfig("http://x", "m", rate=0)
    with pytest.raises(ValueError, match="prompt lengths"):
        LoadConfig("http://x", "m", prompt_lens=(5, 2))
    with pytest.raises(ValueError, match="vocab_size"):
        LoadConfig("http://x", "m", vocab_size=4)
