"""Prometheus metrics of the router (prefix ``kvrelay_``)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

    def observe_finish(self, started: float, reason: str) -> None:
        self.e2e.observe(time.monotonic() - started)
        self.finished.labels(reason).inc()
