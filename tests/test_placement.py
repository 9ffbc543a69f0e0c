"""Prefill placement in prefill work: queued prompt tokens against the tokens a cache hit saves.

``Registry.place`` with exact expectations (block size 16, a 600-token prompt whose first 32
blocks, 512 tokens, are a tenant's system prompt), the old-worker wire default, and a real
worker reporting its queued prompt tokens through the router's ``/admin/instances``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import signal
import time
from typing import Any

import msgpack
import openai
import pytest

from kvrelay.protocol import messages, sampling_params
from kvrelay.protocol.messages import (
    WIRE_TYPES,
    GenerateRequest,
    KvLayout,
    LoadReport,
    PeerInfo,
    Register,
    Role,
    decode,
    encode,
)
from kvrelay.protocol.sampling_params import SamplingParams
from kvrelay.router.dispatcher import DispatcherSettings
from kvrelay.router.prefix_index import PrefixMatch
from kvrelay.router.registry import Registry
from kvrelay.worker.cpu_priority import autogroup_nice
from tests.cluster_harness import metric_value, read_text, running_cluster

LAYOUT = KvLayout(2, 64, 16, 2, 8, "float32")
PROMPT_LEN = 600
SYSTEM = PrefixMatch(32, 0)  # the 512-token system prompt in the device cache


def _registry(
    *prefills: tuple[str, int, int], role: Role = Role.PREFILL, cache_weight: float = 1.0
) -> Registry:
    """Instances of ``role`` (id, queued prompt tokens, waiting requests) and one decode."""
    registry = Registry(cache_weight=cache_weight)
    for instance_id, num_tokens, num_waiting in prefills:
        info = PeerInfo(instance_id, role, "A", "tcp://x:1", "", None, LAYOUT, b"f")
        registry.register(Register(info, "tiny", 4096, 1))
        report = LoadReport(instance_id, num_waiting, 0, 64, 64, num_prefill_tokens=num_tokens)
        registry.report(report)
    info = PeerInfo("d0", Role.DECODE, "A", "tcp://x:2", "", None, LAYOUT, b"f")
    registry.register(Register(info, "tiny", 4096, 1))
    return registry


def _chosen(registry: Registry, matched: dict[str, PrefixMatch] | None = None) -> str:
    placement = registry.place(matched=matched, num_prompt_tokens=PROMPT_LEN)
    assert placement is not None
    return placement.prefill.instance_id


def test_no_match_places_on_the_least_queued_prompt_work_then_the_fewest_requests() -> None:
    # p0 has ten short prompts waiting (40 tokens), p1 one long one (400): tokens decide
    registry = _registry(("p0", 40, 10), ("p1", 400, 1))
    assert _chosen(registry) == "p0"
    assert _chosen(registry, {}) == "p0"
    # equal work: the fewer requests (the old load score) breaks the tie
    assert _chosen(_registry(("p0", 100, 3), ("p1", 100, 1))) == "p1"
    assert _chosen(_registry(("p0", 0, 0), ("p1", 0, 0))) == "p0"  # idle: first registered


@pytest.mark.parametrize("role", [Role.PREFILL, Role.COLOCATED])
def test_a_cache_holder_wins_while_its_queue_is_shorter_than_what_the_hit_saves(
    role: Role,
) -> None:
    # the hit saves 512 of the 600 tokens: the holder's cost is its queue + 88, the idle
    # instance's 600
    for queue, winner in ((0, "holder"), (300, "holder"), (511, "holder"), (513, "idle")):
        registry = _registry(("holder", queue, 1), ("idle", 0, 0), role=role)
        assert _chosen(registry, {"holder": SYSTEM}) == winner, queue
    # a tie in work (512 queued = 512 saved) goes to the fewer requests
    registry = _registry(("holder", 512, 1), ("idle", 0, 0), role=role)
    assert _chosen(registry, {"holder": SYSTEM}) == "idle"


def test_a_cache_holder_with_a_long_queue_loses_to_an_idle_instance() -> None:
    """The issue #16 case: 32 requests queued behind the holder (about 88 new tokens each
    after their shared 512-token prefix) no longer outweigh its 32-block hit."""
    registry = _registry(("holder", 32 * 88, 32), ("idle", 0, 0))
    assert _chosen(registry, {"holder": SYSTEM}) == "idle"
    # an L1 hit counts half (256 tokens): a 200-token queue still loses to it, 300 wins
    host = {"holder": PrefixMatch(0, 32)}
    assert _chosen(_registry(("holder", 200, 2), ("idle", 0, 0)), host) == "holder"
    assert _chosen(_registry(("holder", 300, 2), ("idle", 0, 0)), host) == "idle"


def test_requests_sent_since_the_report_queue_their_uncached_tokens() -> None:
    registry = _registry(("holder", 0, 0), ("idle", 0, 0))
    chosen = []
    for _ in range(7):
        placement = registry.place(matched={"holder": SYSTEM}, num_prompt_tokens=PROMPT_LEN)
        assert placement is not None
        registry.assign(placement)
        chosen.append((placement.prefill.instance_id, placement.num_new_tokens))
    # the holder computes 88 new tokens a request: 6 queued (528) outweigh the 512 saved
    assert chosen == [("holder", 88)] * 6 + [("idle", PROMPT_LEN)]
    holder = registry.get("holder")
    assert holder is not None
    assert (holder.num_assigned, holder.num_assigned_tokens, holder.queued_tokens()) == (
        6,
        528,
        528,
    )
    registry.report(LoadReport("holder", 0, 1, 60, 64, num_prefill_tokens=88))  # it caught up
    assert holder.queued_tokens() == 88 and holder.num_assigned_tokens == 0
    assert _chosen(registry, {"holder": SYSTEM}) == "holder"


def test_cache_weight_is_queued_tokens_per_cached_token() -> None:
    matched = {"holder": SYSTEM}
    queued = (("holder", 100, 1), ("idle", 0, 0))
    assert _chosen(_registry(*queued, cache_weight=1.0), matched) == "holder"  # 512 > 100
    assert _chosen(_registry(*queued, cache_weight=0.1), matched) == "idle"  # 51.2 < 100
    assert _chosen(_registry(*queued, cache_weight=0.0), matched) == "idle"  # load only
    long_queue = (("holder", 1000, 1), ("idle", 0, 0))
    assert _chosen(_registry(*long_queue, cache_weight=2.0), matched) == "holder"  # 1024
    with pytest.raises(ValueError, match="cache_weight must be >= 0"):
        DispatcherSettings("tcp://127.0.0.1:1", cache_weight=-1.0)
    for bad in (math.inf, math.nan):  # inf x 0 saved tokens would be NaN in every cost
        with pytest.raises(ValueError, match="cache_weight must be >= 0 and finite"):
            DispatcherSettings("tcp://127.0.0.1:1", cache_weight=bad)


def _pair(limit: float, prefill_queue: int, decode_queue: int) -> Registry:
    """One prefill and one decode instance with those queued prompt tokens."""
    registry = Registry(prefill_queue_limit=limit)
    for instance_id, role, queue in (
        ("p0", Role.PREFILL, prefill_queue),
        ("d0", Role.DECODE, decode_queue),
    ):
        info = PeerInfo(
            instance_id, role, "A", f"tcp://x:{len(instance_id)}", "", None, LAYOUT, b"f"
        )
        registry.register(Register(info, "tiny", 4096, 1))
        registry.report(LoadReport(instance_id, 0, 0, 64, 64, num_prefill_tokens=queue))
    return registry


def _placed(
    registry: Registry, matched: dict[str, PrefixMatch] | None = None
) -> tuple[str, str | None, bool]:
    placement = registry.place(matched=matched, num_prompt_tokens=PROMPT_LEN)
    assert placement is not None
    decode = None if placement.decode is None else placement.decode.instance_id
    return placement.prefill.instance_id, decode, placement.local_prefill


def test_a_full_prefill_queue_lets_the_decode_instance_compute_the_prompt() -> None:
    handoff, local = ("p0", "d0", False), ("d0", None, True)
    assert _placed(_pair(2048, 0, 0)) == handoff  # idle: always handed off
    assert _placed(_pair(2048, 2047, 0)) == handoff  # under the limit
    assert _placed(_pair(2048, 2048, 0)) == local  # at the limit, the decode starts it sooner
    assert _placed(_pair(2048, 5000, 4999)) == local
    assert _placed(_pair(2048, 5000, 5000)) == handoff  # a tie stays with the prefill
    assert _placed(_pair(2048, 5000, 6000)) == handoff  # the decode is further behind
    assert _placed(_pair(math.inf, 10**9, 0)) == handoff  # inf: strict disaggregation
    assert _placed(_pair(0, 1, 0)) == local
    # each side's own cache hit counts: the prefill's saves 512 of its 600 tokens
    assert _placed(_pair(2048, 2400, 2000), {"p0": SYSTEM}) == handoff  # 2488 < 2600
    assert _placed(_pair(2048, 2400, 1800), {"p0": SYSTEM}) == local  # 2400 < 2488
    assert _placed(_pair(2048, 2400, 2400), {"d0": SYSTEM}) == local  # 2488 < 3000
    with pytest.raises(ValueError, match="prefill_queue_limit must be >= 0"):
        DispatcherSettings("tcp://127.0.0.1:1", prefill_queue_limit=-1.0)
    with pytest.raises(ValueError, match="prefill_queue_limit must be >= 0"):
        DispatcherSettings("tcp://127.0.0.1:1", prefill_queue_limit=math.nan)


def test_a_burst_fills_the_prefill_queue_then_alternates_between_the_two() -> None:
    """Sixteen 600-token prompts at once (no reports between them): the prefill takes them
    up to the limit, then the decode up to the same queue, then they alternate; the decode
    instance is charged what it computes, as a prefill is."""
    registry = _pair(2048, 0, 0)
    chosen = []
    for _ in range(16):
        placement = registry.place(num_prompt_tokens=PROMPT_LEN)
        assert placement is not None
        registry.assign(placement)
        chosen.append(placement.prefill.instance_id)
    assert chosen == ["p0"] * 4 + ["d0"] * 4 + ["p0", "d0"] * 4
    queues = [registry.get(i).queued_tokens() for i in ("p0", "d0")]  # type: ignore[union-attr]
    assert queues == [8 * PROMPT_LEN, 8 * PROMPT_LEN]


def test_a_load_report_from_an_older_worker_decodes_with_no_queued_tokens() -> None:
    report = LoadReport("p0", 2, 1, 60, 64, 0, 0, False, num_prefill_tokens=123)
    assert decode(encode(report)) == report
    values = [getattr(report, f.name) for f in dataclasses.fields(LoadReport)]
    assert values[-2:] == [123, None]  # the newer fields are the last: older senders lack them
    ext = msgpack.ExtType(
        1, msgpack.packb([WIRE_TYPES.index(LoadReport), *values[:-2]], default=messages._default)
    )
    assert decode(msgpack.packb(ext)) == dataclasses.replace(report, num_prefill_tokens=0)


# ---------------------------------------------------------------------------- real processes


def _instance(launcher: Any) -> dict[str, Any]:
    (inst,) = launcher.get_json("/admin/instances")["data"]
    return dict(inst)


def _wait_for(launcher: Any, ready: Any, what: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        inst = _instance(launcher)
        if ready(inst):
            return inst
        assert time.monotonic() < deadline, f"no report {what}: {inst}"
        time.sleep(0.05)


def test_a_worker_reports_its_queued_prompt_tokens(tiny_model_dir, tmp_path) -> None:
    """One seat (--max-num-seqs 1): a long generation holds it, a second prompt waits, and
    the worker's load report counts that prompt's tokens until it runs."""
    worker_args = ("--num-blocks", "512", "--threads", "1", "--max-num-seqs", "1")
    spec = {"num_prefill": 0, "num_decode": 0, "num_colocated": 1, "worker_args": worker_args}
    with running_cluster(tiny_model_dir, tmp_path, **spec) as launcher:
        c = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        assert _instance(launcher)["num_prefill_tokens"] == 0
        kw: dict[str, Any] = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}
        first = c.completions.create(
            prompt="Hold the only seat", max_tokens=3000, stream=True, **kw
        )
        next(iter(first))  # running now
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(c.completions.create, prompt="zebra " * 40, max_tokens=2, **kw)
            inst = _wait_for(launcher, lambda i: i["num_waiting"] == 1, "of a waiting request")
            metrics = read_text(launcher.url + "/metrics")  # the same report, as a gauge
            gauge = metric_value(
                metrics, "kvrelay_num_prefill_tokens", instance=inst["instance_id"]
            )
            worker_metrics = read_text(inst["status_url"] + "/metrics")  # the worker's own
            worker_gauge = metric_value(worker_metrics, "kvrelay_num_prefill_tokens")
            first.close()  # the seat frees; the waiting prompt runs
            second = waiting.result(timeout=120)
        # nothing of it was cached (it shares no block with the first): all its tokens queued
        assert inst["num_prefill_tokens"] == second.usage.prompt_tokens > 16
        assert gauge == worker_gauge == inst["num_prefill_tokens"]
        _wait_for(launcher, lambda i: i["num_running"] == i["num_prefill_tokens"] == 0, "idle")


def test_a_decode_worker_computes_a_prompt_while_the_prefill_worker_is_stuck(
    tiny_model_dir, tmp_path
) -> None:
    """1P+1D with --prefill-queue-limit 1: the prefill worker is paused (SIGSTOP) with a
    request placed on it, so its queue stays charged; the next request runs end to end on
    the decode worker and finishes while the prefill worker is still stopped, with the same
    greedy tokens as the same prompt handed off once the prefill worker is back. (Three
    prompts that share no block: a cache hit on the prefill worker would rightly win it the
    request.)"""
    router_args = ("--dead-after", "60", "--served-model-name", "tiny")
    router_args += ("--prefill-queue-limit", "1")
    # the workers at a lowered priority, as a decode worker on shared cores is: the decode
    # worker computes its own prompt at nice 0 (cpu_priority.follow_prompts)
    worker_args = ("--num-blocks", "512", "--threads", "1", "--cpu-nice", "19")
    spec = {"num_prefill": 1, "num_decode": 1, "router_args": router_args}
    spec["worker_args"] = worker_args
    with running_cluster(tiny_model_dir, tmp_path, **spec) as launcher:
        c = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        kw: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": 12}
        kw["extra_body"] = {"ignore_eos": True}

        def local_prefills() -> float:
            return metric_value(
                read_text(launcher.url + "/metrics"), "kvrelay_local_prefills_total"
            )

        c.completions.create(prompt="apple " * 30, **kw)  # an idle prefill: a hand-off
        assert local_prefills() == 0

        # the router's last view of both must be idle before the prefill worker stops, from
        # reports sent after the last placement: a report sent mid-prefill, or none since the
        # request was placed (num_assigned), would leave the prefill's queue charged (CI
        # failures: the first request then went to the decode worker, the second to the
        # stopped prefill, where it waited out --dead-after)
        def wait_for_idle_reports() -> None:
            deadline = time.monotonic() + 30
            while any(
                i["num_prefill_tokens"] or i["num_running"] or i["num_waiting"] or i["num_assigned"]
                for i in launcher.get_json("/admin/instances")["data"]
            ):
                assert time.monotonic() < deadline, "the workers never reported idle"
                time.sleep(0.05)

        wait_for_idle_reports()
        (prefill,) = [p for p in launcher.procs.values() if p.role == "prefill"]
        prefill.popen.send_signal(signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                stuck = pool.submit(c.completions.create, prompt="zebra " * 30, **kw)
                # placed, not merely in flight: a request counts as in flight before its
                # placement, and the next one overtaking it would take the idle prefill (a CI
                # failure: zebra then ran on the decode worker, mango waited out --dead-after)
                deadline = time.monotonic() + 30
                while not any(
                    i["role"] == "prefill" and i["num_assigned"] == 1
                    for i in launcher.get_json("/admin/instances")["data"]
                ):
                    assert time.monotonic() < deadline, "the first request was never placed"
                    time.sleep(0.02)
                local = c.completions.create(prompt="mango " * 30, **kw)  # prefill stopped
                assert local_prefills() == 1
                assert not stuck.done()
                prefill.popen.send_signal(signal.SIGCONT)
                stuck.result(timeout=120)
        finally:
            prefill.popen.send_signal(signal.SIGCONT)
        wait_for_idle_reports()  # the prefill's report after it resumed: its queue empty
        handed_off = c.completions.create(prompt="mango " * 30, **kw)
        assert local_prefills() == 1
        assert local.choices[0].text == handed_off.choices[0].text
        assert local.usage.completion_tokens == 12
        metrics = read_text(launcher.url + "/metrics")
        assert metric_value(metrics, "kvrelay_request_retries_total") == 0
        (decode,) = [p for p in launcher.procs.values() if p.role == "decode"]
        if autogroup_nice(decode.popen.pid) is not None:  # a kernel with autogroups
            (info,) = [
                i for i in launcher.get_json("/admin/instances")["data"] if i["role"] == "decode"
            ]
            decode_metrics = read_text(info["status_url"].rstrip("/") + "/metrics")
            assert metric_value(decode_metrics, "kvrelay_cpu_priority_raises_total") == 1
            assert autogroup_nice(decode.popen.pid) == 19  # lowered again once idle


# ------------------------------------------------------------- sampling fields (rolling upgrade)

NEWER = frozenset({"logit_bias"})  # a field the workers of the first wire format do not know


def old_register_bytes(info: PeerInfo, pid: int = 1) -> bytes:
    """A ``Register`` as a worker older than ``sampling_fields`` sends it: without the field."""
    values = [info, "tiny", 4096, pid]
    ext = msgpack.ExtType(
        1, msgpack.packb([WIRE_TYPES.index(Register), *values], default=messages._default)
    )
    return msgpack.packb(ext)


def _old_register(info: PeerInfo) -> Register:
    return decode(old_register_bytes(info), Register)


def test_a_register_without_sampling_fields_decodes_as_the_first_wire_formats() -> None:
    info = PeerInfo("p0", Role.PREFILL, "A", "tcp://x:1", "", None, LAYOUT, b"f")
    new = Register(info, "tiny", 4096, 1)
    fields = list(new.sampling_fields)
    assert decode(encode(new)) == dataclasses.replace(new, sampling_fields=fields)
    assert set(new.sampling_fields) >= {"logit_bias", "cache_salt", "prompt_logprobs"}
    assert set(_old_register(info).sampling_fields) == sampling_params.BASE_FIELDS
    assert "logit_bias" not in _old_register(info).sampling_fields


def test_fields_set_names_the_later_fields_a_request_changes() -> None:
    assert SamplingParams(temperature=0, max_tokens=5, stop=["x"]).fields_set() == frozenset()
    params = SamplingParams(logit_bias={3: 1.0}, cache_salt="t", prompt_logprobs=0)
    assert params.fields_set() == {"logit_bias", "cache_salt", "prompt_logprobs"}
    assert SamplingParams(allowed_token_ids=[1]).fields_set() == {"allowed_token_ids"}


def _mixed(*workers: tuple[str, Role, bool]) -> Registry:
    """Instances (id, role, old): an old one registers as a worker before sampling_fields."""
    registry = Registry()
    for port, (instance_id, role, old) in enumerate(workers):
        info = PeerInfo(instance_id, role, "A", f"tcp://x:{port}", "", None, LAYOUT, b"f")
        registry.register(_old_register(info) if old else Register(info, "tiny", 4096, 1))
    return registry


def test_a_request_with_a_newer_field_goes_only_to_workers_that_know_it() -> None:
    # colocated: the old one is first registered, so it wins every tie but this one
    registry = _mixed(("old", Role.COLOCATED, True), ("new", Role.COLOCATED, False))
    placement = registry.place(num_prompt_tokens=8)
    assert placement is not None and placement.prefill.instance_id == "old"
    placement = registry.place(num_prompt_tokens=8, needs=NEWER)
    assert placement is not None and placement.prefill.instance_id == "new"
    assert registry.unknown_field(NEWER) == "logit_bias"  # a worker lacks it (not a refusal)
    assert registry.get("old").as_dict()["unknown_sampling_fields"] == [  # type: ignore[union-attr]
        "cache_salt", "structured_outputs", "logit_bias", "allowed_token_ids", "prompt_logprobs",
        "bad_words_token_ids", "priority", "lora_name",
    ]  # fmt: skip
    assert registry.get("new").as_dict()["unknown_sampling_fields"] == []  # type: ignore[union-attr]


def test_an_old_decode_worker_is_passed_over_and_the_new_prefill_runs_end_to_end() -> None:
    registry = _mixed(("p0", Role.PREFILL, False), ("d0", Role.DECODE, True))
    plain = registry.place(num_prompt_tokens=8)
    assert plain is not None and (plain.prefill.instance_id, plain.decode) == (
        "p0",
        registry.get("d0"),
    )
    placement = registry.place(num_prompt_tokens=8, needs=NEWER)
    assert placement is not None
    assert (placement.prefill.instance_id, placement.decode) == ("p0", None)
    # an old prefill with a new decode: the decode runs it end to end
    registry = _mixed(("p0", Role.PREFILL, True), ("d0", Role.DECODE, False))
    placement = registry.place(num_prompt_tokens=8, needs=NEWER)
    assert placement is not None
    assert (placement.prefill.instance_id, placement.decode) == ("d0", None)


def test_only_old_workers_place_nothing_and_name_the_field() -> None:
    registry = _mixed(("p0", Role.PREFILL, True), ("d0", Role.DECODE, True))
    assert registry.place(num_prompt_tokens=8, needs=frozenset({"cache_salt"})) is None
    assert registry.unknown_field(frozenset({"prompt_logprobs", "cache_salt"})) == "cache_salt"
    assert registry.place(num_prompt_tokens=8) is not None


# ----------------------------------------------------- requests a report does not count yet


def test_a_report_made_before_a_request_arrived_keeps_it_counted() -> None:
    """The heartbeat thread sends the snapshot made before a long step while the requests
    sent meanwhile wait unread; the router keeps each counted until a report took it in."""
    registry = Registry(router_id="r1")
    for instance_id in ("p0", "p1"):
        info = PeerInfo(instance_id, Role.COLOCATED, "A", "tcp://x:1", "", None, LAYOUT, b"f")
        registry.register(Register(info, "tiny", 4096, 1))
    p0, p1 = registry.get("p0"), registry.get("p1")
    assert p0 is not None and p1 is not None
    seqs = []
    for inst, tokens in ((p0, 100), (p1, 150), (p0, 30)):
        placement = registry.place(num_prompt_tokens=tokens)
        assert placement is not None and placement.prefill is inst  # least queued work
        seqs.append(registry.assign(placement))
    assert seqs == [1, 2, 3]  # one count per router, across its instances
    assert (p0.num_assigned, p0.queued_tokens()) == (2, 130)

    def report(taken: dict[str, int] | None, running: int, prefill_tokens: int) -> None:
        registry.report(LoadReport("p0", 0, running, 64, 64, num_prefill_tokens=prefill_tokens,
                                   last_taken=taken))  # fmt: skip

    report({}, 0, 0)  # made before either arrived (a long step): both still counted
    assert (p0.num_assigned, p0.queued_tokens()) == (2, 130)
    report({"r1": 1, "other-router": 9}, 1, 100)  # the first taken in, the third not yet
    assert (p0.num_assigned, p0.queued_tokens()) == (1, 130)
    report({"r1": 3}, 2, 130)
    assert (p0.num_assigned, p0.queued_tokens()) == (0, 130)
    registry.report(LoadReport("p1", 0, 1, 64, 64, num_prefill_tokens=150))  # an older worker
    assert (p1.num_assigned, p1.queued_tokens()) == (0, 150)  # its report counts everything


def test_a_generate_request_and_a_load_report_from_an_older_process_lack_the_new_fields() -> None:
    report = LoadReport("p0", 2, 1, 60, 64, 0, 0, False, 123, {"r": 4})
    assert decode(encode(report)) == report
    request = GenerateRequest("q", [1, 2], SamplingParams(), [], None, "r", 1, 4)
    assert decode(encode(request)) == request
    for msg, num_old in ((report, 9), (request, 7)):
        values = [getattr(msg, f.name) for f in dataclasses.fields(type(msg))]
        ext = msgpack.ExtType(
            1,
            msgpack.packb(
                [WIRE_TYPES.index(type(msg)), *values[:num_old]], default=messages._default
            ),
        )
        old = decode(msgpack.packb(ext))
        assert old == (
            dataclasses.replace(report, last_taken=None)
            if msg is report
            else dataclasses.replace(request, seq=0)
        )


def test_a_request_sent_during_a_long_step_stays_counted_until_a_report_takes_it_in(
    real_model_dir: Any, tmp_path: Any
) -> None:
    """SmolLM2 on one thread: a 1,010-token prompt in 512-token chunks is two long prefill
    steps (seconds each, many 0.2 s heartbeats), during which the heartbeat thread keeps
    sending the report made before the request arrived. Sampled from the router until the
    first token, the request is counted exactly once at every sample (in the report's numbers
    or as sent but not yet taken in); a report that reset the router's count on arrival would
    have made it zero there."""
    worker_args = ("--num-blocks", "512", "--threads", "1", "--max-num-batched-tokens", "512")
    spec = {"num_prefill": 0, "num_decode": 0, "num_colocated": 1, "worker_args": worker_args}
    with running_cluster(real_model_dir, tmp_path, **spec) as launcher:
        c = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        prompt = " ".join(f"item{i}" for i in range(280))  # 1,010 tokens: 2 steps of <= 512
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first_token = pool.submit(
                lambda: next(
                    iter(
                        c.completions.create(model="tiny", prompt=prompt, max_tokens=1, stream=True)
                    )
                )
            )
            samples = []
            while not first_token.done():
                i = _instance(launcher)
                samples.append((i["num_waiting"] + i["num_running"], i["num_assigned"]))
                time.sleep(0.02)
            first_token.result()
        placed = [s for s in samples if s != (0, 0)]
        assert placed, "never saw the request placed"
        assert samples.index(placed[0]) + len(placed) == len(samples), samples  # placed to the end
        assert all(sum(s) == 1 for s in placed), samples
        # reports came while it waited unread, and the router kept it counted
        assert (0, 1) in placed and (1, 0) in placed, samples
