"""``kvrelay bench --trace``: a trace replayed against a real 1P+1D cluster (tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench import trace_requests
from kvrelay.sim.profile import Profile
from kvrelay.sim.trace import TraceRequest
from tests.cluster_harness import running_cluster

LENGTHS = [(24, 5), (8, 9), (40, 3), (17, 7), (33, 1), (12, 6)]  # (prompt, output) tokens


def test_trace_prompts_are_exact_and_hash_ids_repeat_their_blocks() -> None:
    trace = [
        TraceRequest(0.0, 600, 4, (3, 4)),
        TraceRequest(0.5, 520, 2, (3, 9)),
        TraceRequest(1.0, 7, 2),
    ]
    a, b, c = trace_requests(trace, seed=1, vocab_size=100)
    assert [len(r.prompt_ids) for r in (a, b, c)] == [600, 520, 7]
    assert a.prompt_ids[:512] == b.prompt_ids[:512] and a.prompt_ids[512:520] != b.prompt_ids[512:]
    assert all(4 <= t < 100 for t in a.prompt_ids) and (a.output_len, a.arrival_s) == (4, 0.0)
    assert trace_requests(trace, seed=1, vocab_size=100) == [a, b, c]  # seeded


@pytest.mark.timeout(240)
def test_bench_trace_replays_lengths_against_1p1d(tiny_model_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    rows = [
        f"2023-11-16 18:00:{i // 2:02d}.{5 * (i % 2)}000000,{p},{o}"
        for i, (p, o) in enumerate(LENGTHS)
    ]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    with running_cluster(tiny_model_dir, tmp_path / "logs") as launcher:
        cmd = [
            sys.executable, "-m", "kvrelay", "bench", "--url", launcher.url, "--model", "tiny",
            "--trace", str(trace), "--time-scale", "0.5", "--max-requests", "5",
            "--max-prompt-tokens", "36", "--slo-ttft-ms", "30000", "--slo-tpot-ms", "30000",
            "--json", str(out), "--no-progress", "--plot", str(plot),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["num_requests"] == data["num_completed"] == 5
    assert data["config"]["trace"] == str(trace)
    requests = data["requests"]
    want = [(min(p, 36), o) for p, o in LENGTHS[:5]]
    assert [(r["prompt_len"], r["output_len"]) for r in requests] == want
    assert all(r["output_tokens"] == r["output_len"] for r in requests)  # forced lengths
    sent = [r["sent_s"] for r in requests]
    assert sent == sorted(sent) and sent[-1] >= 0.9  # the last arrives at 2 s x 0.5
    assert data["goodput"] == data["request_throughput"] > 0
    pytest.importorskip("matplotlib")
    assert plot.stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_sim_profile_measures_the_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "kvrelay", "sim", "profile", "--model", str(tiny_model_dir),
           "--out", str(out), "--quick", "--repeats", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = Profile.load(out)
    assert profile.model == tiny_model_dir.name and profile.threads == 1
    assert profile.prefill_s(256, 256 * 128) > profile.prefill_s(16, 128) > 0
    assert profile.decode_s(8, 800) > 0
    assert set(profile.start_s) == {"disk", "pool", "peer"} and min(profile.start_s.values()) > 0
    assert all(link.bytes_per_s > 0 for link in profile.handoff.values())
    assert len(profile.points["prefill (tokens, attn, s)"]) == 4
