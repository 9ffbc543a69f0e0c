"""``benchmarks/scale_up.py --quick`` end to end on the tiny model: a smoke test, not a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "scale_up.py"
SHM = Path("/dev/shm")


def _cmdlines() -> list[str]:
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(path.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # the process ended meanwhile
            continue
    return out


@pytest.mark.timeout(180)
def test_scale_up_bench_quick(tmp_path: Path) -> None:
    out_json = tmp_path / "result.json"
    benchmarks_md = REPO_ROOT / "BENCHMARKS.md"
    before = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-write", "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out_json.read_text())

    [ckpt] = data["checkpoints"]
    assert (ckpt["name"], ckpt["dtype"]) == ("tiny", "float32")
    starts = data["starts"]
    assert [s["mode"] for s in starts] == ["disk", "build", "pool", "peer"]
    assert len({s["instance"] for s in starts}) == 4  # a new worker for every mode
    for s in starts:
        assert 0 < s["joined_s"] < s["first_token_s"], s
        assert s["ready_s"] is not None and s["ready_s"] <= s["joined_s"] + 0.01, s
        assert s["resident_bytes"] in (0, None), s  # the checkpoint was evicted
    logged = {s["mode"]: s["weights_logged_s"] for s in starts}
    assert logged["disk"] is None and logged["pool"] is None
    assert logged["build"] > 0 and logged["peer"] > 0  # built from disk, filled from the peer

    [attach] = data["attach"]
    assert len(attach["attach_ms"]) == 5 and len(attach["disk_load_s"]) == 1
    assert min(attach["attach_ms"]) > 0 and attach["pool_bytes"] > 0

    assert data["chain_model"] == "tiny"
    chain = data["chain"]
    link_mbps = data["settings"]["link_mbps"]
    assert link_mbps > 0  # by default both conditions run: unlimited, then link-limited
    conditions = [(c["link_mbps"], c["num_receivers"]) for c in chain]
    assert conditions == [(0, 1), (0, 2), (link_mbps, 1), (link_mbps, 2)]
    assert all(c["is_chain"] and len(c["fetch_s"]) == c["num_receivers"] for c in chain)
    for c in chain[1], chain[3]:
        second = c["sources"]
        assert second[0] != second[1]  # the second receiver pulled from the first
    link_bytes_per_s = link_mbps * 1e6 / 8  # pacing only delays: a lower bound cannot flake
    assert chain[2]["last_done_s"] >= (ckpt["num_bytes"] - (4 << 20)) / link_bytes_per_s
    assert "Chain, unlimited (loopback)" in proc.stdout and "Mbps per server" in proc.stdout

    # nothing left behind: no pool of this run's model, no process using its files
    assert not [p.name for p in SHM.glob(f"kvrelay-params-*{ckpt['fingerprint'][:16]}*")]
    assert not [c for c in _cmdlines() if ckpt["path"] in c]
    after = benchmarks_md.read_bytes() if benchmarks_md.exists() else None
    assert after == before, "--no-write must leave BENCHMARKS.md alone"
