"""Prometheus metrics of one worker (prefix ``kvrelay_``; vLLM's names where they exist)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.free_blocks = gauge("kvrelay_kv_free_blocks", "KV blocks free or evictable")
        self.step_seconds = Histogram(
            "kvrelay_engine_step_seconds",
            "Time of one engine step",
            list(labels),
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(**labels)
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
        self.leases_expired = Counter(
            "kvrelay_kv_leases_expired", "Prefill leases freed without an ack", registry=r
        )

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def update_load(self, engine: LLMEngine) -> None:
        self.num_waiting.set(engine.scheduler.num_waiting)
        self.num_running.set(engine.scheduler.num_running)
        self.kv_usage.set(engine.block_manager.usage)
        self.free_blocks.set(engine.block_manager.num_free_blocks)
