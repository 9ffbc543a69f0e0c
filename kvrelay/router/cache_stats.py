"""``GET /admin/cache/stats``: per tier and per instance, gathered from the workers' ``/stats``.

Shape (documented in the README)::

    {"object": "cache_stats",
     "tiers": {"device": {...}, "host": {..., "pools": [...]}, "redis": {...}},
     "instances": {"<id>": {"role": ..., "tiers": {"device": {...}, ...}}},
     "unreachable": ["<id>", ...],
     "param_pool": null,
     "placement_index": {"device": {"num_blocks": N, "instances": {"<id>": n}},
                         "host": {"num_blocks": N, "hosts": {"<host id>": n}}}}

``placement_index`` is the router's own view (``prefix_index.CacheIndex``): the blocks it
believes each instance's device cache and each host's L1 pool hold, from the workers'
cache events; ``num_blocks`` sums the holders.

Counters (queries, hits, bytes, evictions, errors) are summed over instances; capacity and
use are summed per distinct pool (a host pool is shared by the instances of one host, so it
is counted once); latency quantiles are the worst instance's (a conservative summary).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import httpx

_SUMMED = (
    "query_tokens",
    "hit_tokens",
    "query_blocks",
    "hit_blocks",
    "bytes_read",
    "bytes_written",
    "evictions",
    "errors",
    "put_blocks",
    "dropped_puts",
    "lookups",
)
_POOL_FIELDS = ("capacity_bytes", "used_bytes", "capacity_blocks", "used_blocks")
_DEVICE_SIZES = ("capacity_blocks", "capacity_bytes", "used_blocks", "cached_blocks")


async def fetch_worker_stats(
    status_urls: dict[str, str], timeout: float = 2.0
) -> tuple[dict[str, Any], list[str]]:
    """``/stats`` of every instance (by id), and the ids that did not answer."""

    async def one(client: httpx.AsyncClient, url: str) -> Any:
        resp = await client.get(url + "/stats")
        resp.raise_for_status()
        return resp.json()

    async with httpx.AsyncClient(timeout=timeout) as client:
        results = await asyncio.gather(
            *(one(client, url) for url in status_urls.values()), return_exceptions=True
        )
    stats, unreachable = {}, []
    for instance_id, result in zip(status_urls, results):
        if isinstance(result, BaseException):
            unreachable.append(instance_id)
        else:
            stats[instance_id] = result
    return stats, unreachable


def aggregate(per_instance: dict[str, Any], host_ids: dict[str, str]) -> dict[str, Any]:
    """Cluster-wide figures per tier from each instance's ``tiers`` section."""
    tiers: dict[str, dict[str, Any]] = {}
    pools: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for instance_id, stats in per_instance.items():
        for tier, figures in stats.get("tiers", {}).items():
            total = tiers.setdefault(tier, {})
            _add(total, figures, _SUMMED)
            _worst(total, figures, ("latency_p50_ms", "latency_p99_ms"))
            if "errors_by_reason" in figures:
                by_reason = total.setdefault("errors_by_reason", {})
                for reason, count in figures["errors_by_reason"].items():
                    by_reason[reason] = by_reason.get(reason, 0) + count
            if tier == "device":
                _add(total, figures, _DEVICE_SIZES)
            else:
                key = (host_ids.get(instance_id, instance_id), str(figures.get("name", tier)))
                pools.setdefault(tier, {})[key] = {f: figures.get(f, 0) for f in _POOL_FIELDS}
                for flag in ("available",):
                    if flag in figures:
                        total[flag] = total.get(flag, True) and bool(figures[flag])
    for tier, total in tiers.items():
        queries = total.get("query_tokens", 0)
        total["hit_rate"] = total.get("hit_tokens", 0) / queries if queries else 0.0
        if tier in pools:
            entries = [{"host_id": h, "name": n, **f} for (h, n), f in pools[tier].items()]
            total["pools"] = entries
            for field in _POOL_FIELDS:
                total[field] = sum(e[field] for e in entries)
    return tiers


def _add(total: dict[str, Any], figures: dict[str, Any], names: Iterable[str]) -> None:
    for name in names:
        if name in figures:
            total[name] = total.get(name, 0) + figures[name]


def _worst(total: dict[str, Any], figures: dict[str, Any], names: Iterable[str]) -> None:
    for name in names:
        if name in figures:
            total[name] = max(total.get(name, 0.0), figures[name])


def build_report(
    per_instance: dict[str, Any],
    unreachable: list[str],
    host_ids: dict[str, str],
    index_sizes: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    sizes = index_sizes or {}
    device, host = sizes.get("device", {}), sizes.get("host", {})
    return {
        "object": "cache_stats",
        "tiers": aggregate(per_instance, host_ids),
        "instances": {
            instance_id: {"role": stats.get("role"), "tiers": stats.get("tiers", {})}
            for instance_id, stats in per_instance.items()
        },
        "unreachable": unreachable,
        "param_pool": None,
        "placement_index": {
            "device": {"num_blocks": sum(device.values()), "instances": device},
            "host": {"num_blocks": sum(host.values()), "hosts": host},
        },
    }
