"""Prometheus metrics of one worker (prefix ``kvrelay_``; vLLM's names where they exist)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvrelay.engine.engine import LLMEngine

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class WorkerMetrics:
    """Owns a registry per worker, so two workers in one test process never collide."""

    def __init__(self, instance_id: str, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"instance": instance_id, "role": role}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        self.num_waiting = gauge("kvrelay_num_requests_waiting", "Requests waiting to be scheduled")
        self.num_running = gauge("kvrelay_num_requests_running", "Requests running in the engine")
        self.kv_usage = gauge("kvrelay_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        # the same three under vLLM's names, so existing HPA / KEDA recipes work unchanged
        self.vllm_waiting = gauge("vllm:num_requests_waiting", "Requests waiting (vLLM name)")
        self.vllm_running = gauge("vllm:num_requests_running", "Requests running (vLLM name)")
        self.vllm_kv_usage = gauge("vllm:kv_cache_usage_perc", "KV usage 0-1 (vLLM name)")
        self.free_blocks = gauge("kvrelay_kv_free_blocks", "KV blocks free or evictable")
        self.prefill_tokens = gauge(
            "kvrelay_num_prefill_tokens", "Prompt tokens yet to compute (prefill placement)"
        )
        # the scheduler's running counts (preemptions, speculative decoding's), as counters
        self._scheduler_counters = [
            (Counter(name, doc, list(labels), registry=r).labels(**labels), attr)
            for name, doc, attr in _SCHEDULER_COUNTERS
        ]
        self._scheduler_counts = {attr: 0 for _, attr in self._scheduler_counters}  # last seen
        step_seconds = Histogram(
            "kvrelay_engine_step_seconds",
            "Time of one engine step, by kind: decode (decode tokens only), prefill (prompt "
            "chunks only) or mixed",
            [*labels, "kind"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        kinds = ("decode", "prefill", "mixed")  # LLMEngine.last_step_kind
        self.step_seconds = {kind: step_seconds.labels(**labels, kind=kind) for kind in kinds}
        self.transfer_seconds = Histogram(
            "kvrelay_kv_transfer_seconds",
            "Time of one KV pull (decode side)",
            ["transport"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvrelay_kv_transfer_bytes", "KV bytes pulled (decode side)", ["transport"], registry=r
        )
        self.transfer_failures = Counter(
            "kvrelay_kv_transfer_failures",
            "KV pulls that failed (decode recomputed)",
            ["transport", "reason"],
            registry=r,
        )
        self.orphans_aborted = Counter(
            "kvrelay_orphaned_requests_aborted",
            "Requests aborted because their router went silent (router_timeout) or left",
            registry=r,
        )
        self.superseded_dropped = Counter(
            "kvrelay_superseded_attempts_dropped",
            "Requests dropped here because the router re-ran them elsewhere (this instance "
            "was paused or cut off past --dead-after)",
            registry=r,
        )
        self.leases_expired = Counter(
            "kvrelay_kv_leases_expired", "Prefill leases freed without an ack", registry=r
        )
        self.priority_raises = Counter(
            "kvrelay_cpu_priority_raises",
            "Times this worker, run at a lowered CPU priority (--cpu-nice), went back to nice 0 "
            "to compute a prompt of its own",
            registry=r,
        )

    def watch_tiers(self, tier_stats: Callable[[], dict[str, Any]]) -> None:
        """Exports per-tier cache counters read from ``tier_stats()`` at scrape time."""
        self.registry.register(_TierCollector(tier_stats))

    def observe_step(self, seconds: float, kind: str) -> None:
        self.step_seconds[kind].observe(seconds)

    def update_load(self, engine: LLMEngine) -> None:
        for waiting in (self.num_waiting, self.vllm_waiting):
            waiting.set(engine.scheduler.num_waiting)
        for running in (self.num_running, self.vllm_running):
            running.set(engine.scheduler.num_running)
        for usage in (self.kv_usage, self.vllm_kv_usage):
            usage.set(engine.block_manager.usage)
        self.free_blocks.set(engine.block_manager.num_free_blocks)
        self.prefill_tokens.set(engine.scheduler.num_prefill_tokens())
        for counter, attr in self._scheduler_counters:
            count = getattr(engine.scheduler, attr)
            counter.inc(max(0, count - self._scheduler_counts[attr]))
            self._scheduler_counts[attr] = count


# (metric, help, Scheduler attribute); the speculative ones are vLLM's spec_decode_* counters
_SCHEDULER_COUNTERS = (
    (
        "kvrelay_num_preemptions",
        "Running requests preempted (blocks out, or a more urgent request under the priority "
        "policy); each is recomputed from its tokens",
        "num_preemptions",
    ),
    ("kvrelay_spec_decode_num_drafts", "Decode steps of a request with a draft", "num_drafts"),
    ("kvrelay_spec_decode_num_draft_tokens", "Draft tokens computed", "num_draft_tokens"),
    (
        "kvrelay_spec_decode_num_accepted_tokens",
        "Draft tokens accepted (their share of the draft tokens is the acceptance rate)",
        "num_accepted_tokens",
    ),
)


_TIER_COUNTERS = (
    ("kvrelay_prefix_cache_queries", "Prompt tokens looked up in the tier", "query_tokens"),
    ("kvrelay_prefix_cache_hits", "Prompt tokens the tier served", "hit_tokens"),
    ("kvrelay_cache_tier_bytes_read", "Bytes read from the tier", "bytes_read"),
    ("kvrelay_cache_tier_bytes_written", "Bytes written to the tier", "bytes_written"),
    ("kvrelay_cache_tier_evictions", "Blocks evicted from the tier", "evictions"),
)
_TIER_GAUGES = (
    ("kvrelay_cache_tier_capacity_bytes", "Capacity of the tier", "capacity_bytes"),
    ("kvrelay_cache_tier_used_blocks", "Blocks held by the tier", "used_blocks"),
)


class _TierCollector(Collector):
    """Reads the worker's tier figures at scrape time (labels: tier)."""

    def __init__(self, tier_stats: Callable[[], dict[str, Any]]) -> None:
        self._tier_stats = tier_stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._tier_stats()
        for name, doc, field in _TIER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, figures in stats.items():
                if field in figures:
                    family.add_metric([tier], float(figures[field]))
            yield family
        yield _errors_family(stats)
        for name, doc, field in _TIER_GAUGES:
            gauge_family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, figures in stats.items():
                if field in figures:
                    gauge_family.add_metric([tier], float(figures[field]))
            yield gauge_family


def _errors_family(stats: dict[str, Any]) -> CounterMetricFamily:
    """``kvrelay_cache_tier_errors_total{tier, reason}``: failed operations and rejected
    blocks (``unavailable``, ``bad_mac``, ``decrypt_failed``, ``unkeyed``, ...)."""
    family = CounterMetricFamily(
        "kvrelay_cache_tier_errors",
        "Failed tier operations and rejected blocks (read as misses)",
        labels=["tier", "reason"],
    )
    for tier, figures in stats.items():
        by_reason = figures.get("errors_by_reason", {})
        for reason, count in sorted(by_reason.items()):
            family.add_metric([tier, reason], float(count))
        other = figures.get("errors", 0) - sum(by_reason.values())
        if other or ("errors" in figures and not by_reason):
            family.add_metric([tier, "other"], float(other))
    return family
