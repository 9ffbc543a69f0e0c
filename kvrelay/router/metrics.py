"""Prometheus metrics of the router (prefix ``kvrelay_``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvrelay.router.registry import Registry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    """Owns its registry, so two routers in one test process never collide."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "kvrelay_time_to_first_token_seconds",
            "Time from request admission to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvrelay_inter_token_latency_seconds",
            "Time between consecutive tokens of one request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvrelay_e2e_request_latency_seconds",
            "Time from admission to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            "kvrelay_requests", "Requests finished, by reason", ["finish_reason"], registry=r
        )
        self.retries = Counter(
            "kvrelay_request_retries", "Requests re-run after a worker died", registry=r
        )
        self.inflight = Gauge("kvrelay_requests_inflight", "Requests in flight", registry=r)
        self.dropped_events = Counter(
            "kvrelay_token_events_dropped",
            "Token events dropped, by reason: unknown_request (another router's, or one it "
            "forgot), finished_request (it already finished), superseded_attempt (from an "
            "attempt the router re-ran elsewhere), not_assigned (from an instance this router did "
            "not give the request to, or from a connection that is not that instance's)",
            ["reason"],
            registry=r,
        )
        self.loop_stalls = Counter(
            "kvrelay_router_loop_stalls",
            "Times the router's event loop was held past a reaper tick (not counted against "
            "worker liveness)",
            registry=r,
        )
        self.refused_control = Counter(
            "kvrelay_control_messages_refused",
            "Control messages refused, by reason: id_taken (a Register for an instance id live "
            "on another connection), foreign_connection (a load report or cache event for an "
            "instance from a connection that is not its own)",
            ["reason"],
            registry=r,
        )
        for reason in ("unknown_request", "finished_request", "superseded_attempt", "not_assigned"):
            self.dropped_events.labels(reason)  # exported at 0 before the first drop
        for reason in ("id_taken", "foreign_connection"):
            self.refused_control.labels(reason)
        self.local_prefills = Counter(
            "kvrelay_local_prefills",
            "Requests computed end to end on a decode instance because the prefill instance's "
            "queue was at --prefill-queue-limit or more and the decode would start them sooner",
            registry=r,
        )
        self.lora_requests = Counter(
            "kvrelay_lora_requests",
            "Requests placed through a LoRA adapter, by adapter (the request's model)",
            ["adapter"],
            registry=r,
        )
        self.embedding_inputs = Counter(
            "kvrelay_embedding_inputs",
            "Pooled inputs placed: one a vector (/v1/embeddings), a text's scores"
            " (/classify) or a scored text or pair (/score, /rerank)",
            registry=r,
        )
        self.embedding_tokens = Counter(
            "kvrelay_embedding_input_tokens",
            "Tokens of the pooled inputs placed",
            registry=r,
        )
        self.placement_hits = Counter(
            "kvrelay_placement_prefix_hits",
            "Requests placed on a prefill instance expected to hold a prefix of the prompt, "
            "by tier (device: its own cache; host: its host's L1 pool, after the device part)",
            ["tier"],
            registry=r,
        )
        self.placement_blocks = Counter(
            "kvrelay_placement_prefix_blocks",
            "Prompt blocks the chosen prefill instance was expected to hold, by tier",
            ["tier"],
            registry=r,
        )
        for tier in ("device", "host"):  # exported at 0 before the first hit
            self.placement_hits.labels(tier)
            self.placement_blocks.labels(tier)

    def watch_registry(self, registry: Registry) -> None:
        """Exports every instance's last load report (labels: instance, role)."""
        self.registry.register(_LoadCollector(registry))

    def observe_placement(self, num_device_blocks: int, num_host_blocks: int) -> None:
        for tier, num_blocks in (("device", num_device_blocks), ("host", num_host_blocks)):
            if num_blocks:
                self.placement_hits.labels(tier).inc()
                self.placement_blocks.labels(tier).inc(num_blocks)

    def observe_finish(self, started: float, reason: str) -> None:
        self.e2e.observe(time.monotonic() - started)
        self.finished.labels(reason).inc()


_LOAD_GAUGES = (
    ("kvrelay_num_requests_waiting", "Requests waiting on the instance"),
    ("kvrelay_num_requests_running", "Requests running on the instance"),
    ("kvrelay_kv_cache_usage_perc", "Fraction of the instance's KV blocks in use (0-1)"),
    ("kvrelay_num_prefill_tokens", "Prompt tokens the instance has yet to compute (placement)"),
    ("vllm:num_requests_waiting", "Requests waiting (vLLM name)"),
    ("vllm:num_requests_running", "Requests running (vLLM name)"),
    ("vllm:kv_cache_usage_perc", "KV usage 0-1 (vLLM name)"),
)


class _LoadCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        instances = self._registry.instances()
        for name, doc in _LOAD_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["instance", "role"])
            for inst in instances:
                load = inst.load
                if name.endswith("waiting"):
                    value = float(load.num_waiting)
                elif name.endswith("running"):
                    value = float(load.num_running)
                elif name.endswith("prefill_tokens"):
                    value = float(load.num_prefill_tokens)
                else:
                    value = 1.0 - load.num_free_blocks / max(1, load.num_total_blocks)
                family.add_metric([inst.instance_id, inst.role.value], value)
            yield family
