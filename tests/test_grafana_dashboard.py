"""``deploy/grafana/kvrelay.json``: a Grafana dashboard over kvrelay's real metrics.

Every metric a query names is one kvrelay exposes (the families of the router's and a
worker's registries, with the sample suffixes Prometheus gives their types), every label a
query groups by is one that metric carries, and every metric kvrelay exposes is on a panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvrelay.router.metrics import RouterMetrics
from kvrelay.worker.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvrelay.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_METRIC = re.compile(r"\b(kvrelay_[a-z0-9_]+)")
_BY = re.compile(r"by \(([^)]*)\)")
# Labels every series gets from its scrape target (the PodMonitors), besides kvrelay's own.
TARGET_LABELS = {"namespace", "pod", "le"}
# Tier statistics come from a collector that yields families only once tiers exist.
TIER_FAMILIES = {
    "kvrelay_prefix_cache_queries": ("counter", {"tier"}),
    "kvrelay_prefix_cache_hits": ("counter", {"tier"}),
    "kvrelay_cache_tier_bytes_read": ("counter", {"tier"}),
    "kvrelay_cache_tier_bytes_written": ("counter", {"tier"}),
    "kvrelay_cache_tier_evictions": ("counter", {"tier"}),
    "kvrelay_cache_tier_errors": ("counter", {"tier"}),
    "kvrelay_cache_tier_capacity_bytes": ("gauge", {"tier"}),
    "kvrelay_cache_tier_used_blocks": ("gauge", {"tier"}),
}


def exposed() -> dict[str, set[str]]:
    """Sample name -> its labels, for every kvrelay metric a router or a worker exposes."""
    families: dict[str, tuple[str, set[str]]] = dict(TIER_FAMILIES)
    worker = WorkerMetrics("decode-0", "decode")
    worker.watch_tiers(lambda: {})
    for registry in (RouterMetrics().registry, worker.registry):
        for family in registry.collect():
            if family.name.startswith("kvrelay_"):
                labels = {k for s in family.samples for k in s.labels} | _declared(family)
                known = families.get(family.name, (family.type, set()))[1]
                families[family.name] = (family.type, labels | known)
    return {
        name + suffix: labels
        for name, (kind, labels) in families.items()
        for suffix in _SUFFIXES[kind]
    }


def _declared(family: Any) -> set[str]:
    """Labels of a labelled family that has no sample yet (from its collector)."""
    known = {
        "kvrelay_requests": {"finish_reason"},
        "kvrelay_token_events_dropped": {"reason"},
        "kvrelay_placement_prefix_hits": {"tier"},
        "kvrelay_placement_prefix_blocks": {"tier"},
        "kvrelay_kv_transfer_seconds": {"transport", "instance", "role"},
        "kvrelay_kv_transfer_bytes": {"transport", "instance", "role"},
        "kvrelay_kv_transfer_failures": {"transport", "reason", "instance", "role"},
        "kvrelay_engine_step_seconds": {"instance", "role", "kind"},
        "kvrelay_lora_requests": {"adapter"},
    }
    return known.get(family.name, set())


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def test_every_query_names_real_metrics_and_labels() -> None:
    metrics = exposed()
    for title, expr in queries():
        names = _METRIC.findall(expr)
        assert names, f"{title}: {expr} names no kvrelay metric"
        for name in names:
            assert name in metrics, f"{title}: kvrelay exposes no {name}"
        grouped = {label.strip() for by in _BY.findall(expr) for label in by.split(",")}
        carried = set.union(*(metrics[n] for n in names)) | TARGET_LABELS
        assert grouped <= carried, f"{title}: groups by {grouped - carried}, not carried"


def test_every_kvrelay_metric_is_on_a_panel() -> None:
    shown = {name for _, expr in queries() for name in _METRIC.findall(expr)}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exposed()}
    missing = {f for f in families if not any(s.startswith(f) for s in shown)}
    assert not missing, f"no panel shows {sorted(missing)}"


def test_the_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvrelay" and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for _, expr in queries():
        assert set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"} <= variables, expr
