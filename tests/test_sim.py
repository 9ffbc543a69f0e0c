"""``kvrelay sim``: determinism, the real placement and policy (no copies), trace parsing,
the workload model, the segment LRU, the profile format, and the CLI end to end."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import kvrelay.sim
from kvrelay.autoscale import autoscaler, policy
from kvrelay.protocol.messages import LoadReport
from kvrelay.router import instance, load_order, prefix_index, registry
from kvrelay.sim import router_glue
from kvrelay.sim.cache import SegmentLru
from kvrelay.sim.profile import (
    Link,
    Profile,
    StepModel,
    fit_base,
    fit_linear,
    interpolate,
)
from kvrelay.sim.report import summarize
from kvrelay.sim.simulator import FleetConfig, Simulator
from kvrelay.sim.trace import TraceError, TraceRequest, cap_requests, load_trace
from kvrelay.sim.workload import WorkloadConfig, build_requests

TRACES = Path("/work/shared/traces")


def make_profile() -> Profile:
    return Profile(
        model="fake",
        machine="test",
        threads=1,
        block_size=16,
        kv_bytes_per_block=16 * 1024,
        kv_blocks_per_gib=4096,
        prefill=StepModel(0.01, 1e-3, 1e-7),
        decode=StepModel(0.005, 1e-3, 1e-6),
        handoff={"shm": Link(1e-4, 5e9), "tcp": Link(5e-4, 1e9)},
        start_s={"disk": 8.0, "pool": 3.0, "peer": 5.0},
    )


def synthetic_trace(n: int = 400, gap_s: float = 0.05) -> list[TraceRequest]:
    return [
        TraceRequest(i * gap_s + (i % 7) * 0.005, 200 + (i * 37) % 900, 1 + (i * 13) % 60)
        for i in range(n)
    ]


def run_sim(fleet: FleetConfig, rate: float = 1.0, seed: int = 0, **workload: Any) -> Simulator:
    profile = make_profile()
    requests = build_requests(
        synthetic_trace(), WorkloadConfig(rate=rate, seed=seed, tenants=5, **workload), 16
    )
    sim = Simulator(profile, fleet, requests)
    sim.run()
    sim.check_integrity()
    return sim


# ---------------------------------------------------------------------------- determinism


def test_same_seed_same_result_and_every_request_finishes() -> None:
    fleet = FleetConfig(prefill=1, decode=1, autoscale=True, kv_gib=0.05)
    a = summarize(run_sim(fleet, rate=3.0))
    b = summarize(run_sim(fleet, rate=3.0))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["num_completed"] == a["num_requests"] > 400  # rate 3 of 400 requests
    assert a["ttft_ms"]["p50"] > 0 and a["tpot_ms"]["p50"] > 0
    assert a["hit_rate"]["device"] > 0  # 5 tenants share system prompts
    other = summarize(run_sim(fleet, rate=3.0, seed=1))
    assert json.dumps(other, sort_keys=True) != json.dumps(a, sort_keys=True)


def test_colocated_fleet_runs_end_to_end_and_first_token_precedes_finish() -> None:
    sim = run_sim(FleetConfig(prefill=0, decode=0, colocated=2))
    assert all(
        r.prefill_id == r.decode_id and r.prefill_id.startswith("colocated")
        for r in sim.requests
        if r.output_len > 1
    )
    assert all(r.arrival_s < r.first_token_s <= r.finish_s for r in sim.requests)


# ---------------------------------------------------------------------------- the real code


class Spy:
    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_sim_calls_the_routers_placement_and_the_autoscalers_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the glue's names are the real functions, not look-alikes
    assert router_glue.role_observation is autoscaler.role_observation
    assert router_glue.live_instances is autoscaler.live_instances
    assert router_glue.Registry is registry.Registry
    assert router_glue.CacheIndex is prefix_index.CacheIndex
    assert router_glue.Policy is policy.Policy
    spies = {
        "place": Spy(registry.Registry.place),
        "match": Spy(prefix_index.CacheIndex.match),
        "decide": Spy(policy.Policy.decide),
        "signals": Spy(policy.signals),
        "role_observation": Spy(autoscaler.role_observation),
    }
    monkeypatch.setattr(registry.Registry, "place", lambda *a, **k: spies["place"](*a, **k))
    monkeypatch.setattr(prefix_index.CacheIndex, "match", lambda *a, **k: spies["match"](*a, **k))
    monkeypatch.setattr(policy.Policy, "decide", lambda *a, **k: spies["decide"](*a, **k))
    monkeypatch.setattr(policy, "signals", spies["signals"])
    monkeypatch.setattr(router_glue, "role_observation", spies["role_observation"])
    sim = run_sim(FleetConfig(prefill=1, decode=1, autoscale=True), rate=4.0)
    num = len(sim.requests)
    assert spies["place"].calls == num
    assert 0 < spies["match"].calls <= num  # requests with a shared prefix
    assert spies["decide"].calls > 0 and spies["signals"].calls > 0  # not for a held role
    assert spies["role_observation"].calls == 2 * spies["decide"].calls
    assert sim.decisions, "the policy never scaled under 4x load"


def test_load_only_placement_never_consults_the_cache_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    match = Spy(prefix_index.CacheIndex.match)
    monkeypatch.setattr(prefix_index.CacheIndex, "match", lambda *a, **k: match(*a, **k))
    run_sim(FleetConfig(prefill=2, decode=1, placement="load-only"))
    assert match.calls == 0


def test_sim_instances_report_their_queued_prompt_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sim's LoadReports carry ``num_prefill_tokens`` as a worker's do (waiting prompts
    less their device hit, the rest of running ones; ``check_integrity`` checks the sum)."""
    reports: list[LoadReport] = []
    real = registry.Registry.report

    def spy(self: registry.Registry, load: LoadReport, now: float | None = None) -> Any:
        reports.append(load)
        return real(self, load, now)

    monkeypatch.setattr(registry.Registry, "report", spy)
    run_sim(FleetConfig(prefill=1, decode=1), rate=3.0)
    queued = [r.num_prefill_tokens for r in reports if r.instance_id.startswith("prefill")]
    assert min(queued) >= 0 and max(queued) > 1000  # a prefill queue builds at 3x on one
    assert all(r.num_prefill_tokens == 0 for r in reports if r.instance_id.startswith("decode"))


def test_a_full_prefill_queue_moves_prompts_to_the_decode_at_the_cost_of_its_tpot() -> None:
    """Conditional disaggregation in the fleet (``Registry.place``, the router's code): one
    prefill instance behind the load; past --prefill-queue-limit the decode instance takes
    prompts too. TTFT falls and the decode's TPOT rises: a decode step that carries a prompt
    is long for every stream on it (why the router's default is inf)."""
    strict = run_sim(FleetConfig(prefill=1, decode=1), rate=1.0)  # the default: inf
    fallback = run_sim(FleetConfig(prefill=1, decode=1, prefill_queue_limit=2048), rate=1.0)
    assert strict.fleet.prefill_queue_limit == math.inf
    a, b = summarize(strict), summarize(fallback)
    assert b["ttft_ms"]["p50"] < 0.6 * a["ttft_ms"]["p50"]
    assert b["tpot_ms"]["p50"] > 5 * a["tpot_ms"]["p50"]


def _placement_summary(placement: str, rate: float) -> dict[str, Any]:
    requests = build_requests(synthetic_trace(), WorkloadConfig(rate=rate, tenants=3), 16)
    fleet = FleetConfig(prefill=8, decode=4, placement=placement)  # type: ignore[arg-type]
    sim = Simulator(make_profile(), fleet, requests)
    sim.run()
    sim.check_integrity()
    return summarize(sim)


def test_cache_aware_placement_does_not_pile_a_tenant_onto_its_cache_holder() -> None:
    """Issue #16: weighing blocks against queued requests sent each tenant to the instance
    holding its system prompt until 32 requests queued there (here TTFT p99 3.2 s vs 0.9 s
    load-only at 1x, attainment 0.65 vs 0.76 at 2x). In prefill tokens, cache-aware
    placement hits at least as often and costs no tail latency."""
    for rate in (1.0, 2.0):
        aware, load = _placement_summary("cache-aware", rate), _placement_summary("load-only", rate)
        assert aware["hit_rate"]["device"] >= load["hit_rate"]["device"], rate
        assert aware["ttft_ms"]["p99"] <= 1.25 * load["ttft_ms"]["p99"], rate
        assert aware["slo_attainment"] >= load["slo_attainment"] - 0.01, rate


REAL_DECISIONS = [
    registry.Registry.place,
    registry.Registry._cheapest,
    registry.Registry._least_busy_decode,
    registry.Registry.assign,
    load_order.LoadOrder.in_order,
    instance.Instance.load_score,
    instance.Instance.queued_tokens,
    prefix_index.CacheIndex.match,
    prefix_index.PrefixIndex.matched_blocks,
    prefix_index.PrefixIndex.num_held_from,
    policy.Policy.decide,
    policy.Policy._judge,
    policy.Policy._grow,
    policy.Policy._shrink,
    policy.signals,
    policy._up_triggers,
    policy._under_watermark,
    policy._pick_drain,
    autoscaler.instance_load,
    autoscaler.role_observation,
    autoscaler.live_instances,
]


def _body_dump(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    body = [
        s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def test_no_function_in_kvrelay_sim_copies_a_placement_or_policy_function() -> None:
    real = {}
    for fn in REAL_DECISIONS:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        node = tree.body[0]
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        real[_body_dump(node)] = fn.__qualname__
    names = {fn.__name__ for fn in REAL_DECISIONS} - {"assign"}
    sim_dir = Path(kvrelay.sim.__file__).parent
    checked = 0
    for path in sorted(sim_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                checked += 1
                where = f"{path.name}:{node.lineno} {node.name}"
                assert node.name not in names, f"{where} shadows a real decision function"
                assert _body_dump(node) not in real, f"{where} copies {real.get(_body_dump(node))}"
    assert checked > 30


# ---------------------------------------------------------------------------- traces


def test_traces_parse_both_formats(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
    )
    rows = load_trace(csv)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(4808, 10), (3180, 8)]
    assert rows[0].arrival_s == 0 and rows[1].arrival_s == pytest.approx(0.052)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        '{"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 0, "input_length": 30, "output_length": 2}\n'
    )
    rows = load_trace(jsonl)
    assert rows == [TraceRequest(0.0, 30, 2, ()), TraceRequest(1.0, 700, 5, (1, 2))]
    capped = cap_requests(rows, max_requests=2, max_prompt_tokens=500, time_scale=2.0)
    assert capped[1] == TraceRequest(2.0, 500, 5, (1,))


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,10,2\n"
         "2023-11-16 18:17:04.1,ten,2\n", r"a\.csv:3: ContextTokens must be an integer"),
        ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,10\n",
         r"b\.csv:2: expected 3 fields"),
        ("c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n",
         r"c\.csv:2: bad TIMESTAMP"),
        ("d.csv", "time,in,out\n", r"d\.csv:1: expected the header"),
        ("e.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"timestamp": 1,\n',
         r"e\.jsonl:2: not JSON"),
        ("f.jsonl", '{"timestamp": 0, "output_length": 1}\n',
         r"f\.jsonl:1: missing 'input_length'"),
        ("g.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": "x"}\n',
         r"g\.jsonl:1: hash_ids must be a list"),
        ("h.jsonl", "\n", r"no requests"),
    ],
)  # fmt: skip
def test_a_malformed_trace_names_the_line(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=match):
        load_trace(path)


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces are not on this machine")
def test_the_shared_traces_load() -> None:
    conv = load_trace(TRACES / "azure-llm-2023-conv.csv")
    assert len(conv) == 19366 and conv[0] == TraceRequest(0.0, 374, 44)


# ---------------------------------------------------------------------------- workload


def test_rate_multiplier_superposes_copies_and_bursts_add_load() -> None:
    trace = synthetic_trace()
    one = build_requests(trace, WorkloadConfig(rate=1.0), 16)
    assert [(r.prompt_len, r.output_len) for r in one] == [
        (t.prompt_len, t.output_len) for t in trace
    ]
    three = build_requests(trace, WorkloadConfig(rate=3.0), 16)
    assert len(three) == 3 * len(trace)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(three))
    burst = build_requests(
        trace, WorkloadConfig(burst_rate=5.0, burst_start_s=5, burst_len_s=5), 16
    )
    inside = [r for r in burst if 5 <= r.arrival_s < 10]
    assert len(inside) > 3 * sum(1 for t in trace if 5 <= t.arrival_s < 10)
    r = one[3]  # 311-token prompt of tenant-shared prefix: 512-token system prompt, capped
    assert r.segments[0][1] + r.unique_blocks == (r.prompt_len - 1) // 16


def test_mooncake_hash_ids_become_shared_segments() -> None:
    trace = [TraceRequest(0.0, 1100, 4, (7, 8, 9)), TraceRequest(1.0, 600, 4, (7, 3))]
    a, b = build_requests(trace, WorkloadConfig(), 16)
    assert a.segments == ((7, 32), (8, 32), (9, 4)) and a.unique_blocks == 0
    assert b.segments == ((7, 32), (3, 5))


def test_segment_lru_evicts_least_recent_and_reports_net_changes() -> None:
    lru = SegmentLru(10)
    lru.put(1, 4)
    lru.put(2, 4)
    assert lru.leading(((1, 4), (3, 1), (2, 4)), 0) == 1  # 1 is now the most recent
    lru.put(-5, 4)  # a request's unique blocks evict 2, the least recent
    assert 1 in lru and 2 not in lru and lru.used_blocks == 8
    lru.check_integrity()
    stored, evicted = lru.drain_events()
    # the net state: 1 held, 2 gone (an eviction the index had not heard of is a no-op there);
    # -5 (unique blocks) is never reported
    assert stored == [(1, 4)] and evicted == [(2, 4)]
    lru.put(3, 20)  # larger than the cache: not kept
    assert 3 not in lru and lru.drain_events() == ([], [])


def test_profile_round_trips_and_rejects_a_missing_start_mode(tmp_path: Path) -> None:
    prof = make_profile()
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    data = prof.to_json()
    data["start_s"] = {"disk": 1.0}
    with pytest.raises(ValueError, match="lacks"):
        Profile.from_json(data)
    assert prof.step_s(100, 5000.0, 4, 400) < prof.prefill_s(100, 5000.0) + prof.decode_s(4, 400)


def test_decode_steps_follow_the_measured_batch_sizes(tmp_path: Path) -> None:
    """A profile with decode_base interpolates between measured batch sizes (a lone
    sequence's step is not the line's intercept); one without it stays linear."""
    linear = make_profile()
    assert linear.decode_s(4, 400) == pytest.approx(0.005 + 4e-3 + 400e-6)
    rows = [(1.0, 100.0, 0.045), (1.0, 1000.0, 0.054), (8.0, 800.0, 0.0908),
            (8.0, 8000.0, 0.0980), (32.0, 3200.0, 0.1632)]  # fmt: skip
    model = fit_linear(rows)
    base = fit_base(rows, model)
    assert [seqs for seqs, _ in base] == [1.0, 8.0, 32.0]
    prof = dataclasses.replace(linear, decode=model, decode_base=base)
    # at a measured size the context term restores the measured time (up to the fit)
    assert prof.decode_s(1, 100) == pytest.approx(0.045, abs=0.005)
    assert prof.decode_s(1, 100) < model.intercept_s + model.per_item_s + 100 * model.per_attn_s
    # between sizes: between their times; beyond the last: along the last segment
    assert prof.decode_s(1, 0) < prof.decode_s(4, 0) < prof.decode_s(8, 0)
    slope = (base[2][1] - base[1][1]) / 24
    assert prof.decode_s(64, 0) == pytest.approx(base[2][1] + slope * 32)
    assert prof.decode_s(0, 0) == base[0][1]  # below the first: the first
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    assert interpolate([[2.0, 5.0]], 9.0) == 5.0


def test_prefill_steps_follow_the_measured_token_counts(tmp_path: Path) -> None:
    """A profile with prefill_base goes through each measured prompt size (a CPU's cost per
    token is not constant: one line overstates the middle sizes); one without it stays linear."""
    linear = make_profile()
    assert linear.prefill_s(100, 5000.0) == pytest.approx(
        linear.prefill.intercept_s
        + 100 * linear.prefill.per_item_s
        + 5000 * linear.prefill.per_attn_s
    )
    # (tokens, attn, s): 5.8 ms a token at 32, 2.6 at 256, 3.3 past it (a curved profile)
    rows = [(32.0, 512.0, 0.185), (64.0, 1024.0, 0.298), (128.0, 8192.0, 0.441),
            (256.0, 16384.0, 0.690), (512.0, 131072.0, 1.691), (1024.0, 262144.0, 3.241),
            (1024.0, 524288.0, 3.594), (2048.0, 2097152.0, 8.016)]  # fmt: skip
    model = fit_linear(rows)
    base = fit_base(rows, model)
    assert [tokens for tokens, _ in base] == [32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0]
    prof = dataclasses.replace(linear, prefill=model, prefill_base=base)
    for tokens, attn, seconds in rows[:5]:  # every measured size, to within 3%
        assert prof.prefill_s(int(tokens), attn) == pytest.approx(seconds, rel=0.03)
    line_256 = model.intercept_s + 256 * model.per_item_s + 16384 * model.per_attn_s
    assert abs(line_256 - 0.690) > 3 * abs(prof.prefill_s(256, 16384.0) - 0.690)
    assert prof.prefill_s(100, 0.0) < prof.prefill_s(200, 0.0)  # between sizes: monotone
    # a mixed step still shares one overhead
    assert prof.step_s(100, 5000.0, 4, 400) < prof.prefill_s(100, 5000.0) + prof.decode_s(4, 400)
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof


def test_sim_cli_writes_json(tmp_path: Path) -> None:
    make_profile().save(tmp_path / "p.json")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 100 * i, "input_length": 300, "output_length": 20,
                        "hash_ids": [1, 100 + i]}) + "\n"
            for i in range(50)
        )
    )  # fmt: skip
    cmd = [sys.executable, "-m", "kvrelay", "sim", "run", "--profile", str(tmp_path / "p.json"),
           "--trace", str(trace), "--prefill", "2", "--decode", "1",
           "--json", str(tmp_path / "o.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["num_completed"] == 50 and data["fleet"]["prefill"] == 2
    assert data["hit_rate"]["device"] > 0  # hash id 1 is every prompt's first block
    assert "goodput" in proc.stdout


def test_fleet_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="start_mode"):
        FleetConfig(start_mode="tape")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="colocated fleet is fixed"):
        FleetConfig(colocated=2, autoscale=True)
    assert dataclasses.replace(FleetConfig(), prefill=3).prefill == 3
