"""``benchmarks/prefix_cache.py`` end to end on the tiny model: a smoke test, not a timing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "prefix_cache.py"


@pytest.mark.timeout(180)
def test_prefix_cache_bench_quick(tiny_model_dir: Path, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    out_json = tmp_path / "result.json"
    benchmarks_md = REPO_ROOT / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    cmd = [
        sys.executable, str(SCRIPT), "--model", str(tiny_model_dir),  # the suite's, made once
        "--users", "2", "--turns", "2", "--system-tokens", "200", "--repeats", "1",
        "--configs", "L1,L1+L2", "--quiet-wait", "0", "--no-write", "--json", str(out_json),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out_json.read_text())
    summaries = {s["config"]: s for s in data["summaries"]}
    assert set(summaries) == {"L1", "L1+L2"}
    for summary in summaries.values():
        assert summary["num_requests"] == 4
        assert summary["num_computed_tokens"] < summary["num_prompt_tokens"]
    assert summaries["L1"]["cached_tokens_by_tier"].get("device", 0) > 0
    assert summaries["L1+L2"]["cached_tokens_by_tier"].get("redis", 0) > 0
    turns = data["passes"]["L1"][0]
    assert [(t["user"], t["turn"]) for t in turns] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert turns[0]["num_cached_tokens"] == 0  # the first request computes the shared prefix
    assert all(t["num_cached_tokens"] > 0 for t in turns[1:])
    after = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    assert after == before, "--no-write must leave BENCHMARKS.md alone"
