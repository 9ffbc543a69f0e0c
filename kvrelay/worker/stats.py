"""What a worker reports about its KV cache: per-tier sizes, queries, hits and evictions.

Decides the body of ``tiers`` in a worker's ``/stats`` (and so the per-tier Prometheus
counters, read from it at scrape time): the device tier from the block manager, the host pool
and Redis tiers from ``TieredCache.stats()``, with hits counted in tokens and in blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.cachetier.manager import TieredCache
    from kvrelay.engine.engine import LLMEngine


def tier_stats(engine: LLMEngine, tiers: TieredCache | None) -> dict[str, Any]:
    """Per tier: this instance's queries and hits (tokens and blocks), sizes, errors."""
    bm = engine.block_manager
    block_size = bm.block_size
    device: dict[str, Any] = {
        "capacity_blocks": bm.num_blocks,
        "capacity_bytes": engine.runner.kv_cache.nbytes,
        "used_blocks": bm.num_leaked(),
        "cached_blocks": bm.num_cached_blocks,
        "query_tokens": bm.num_query_tokens,
        "hit_tokens": bm.num_hit_tokens,
        "hit_blocks": bm.num_hit_tokens // block_size,
        "evictions": bm.num_evictions,
    }
    device["hit_rate"] = bm.num_hit_tokens / bm.num_query_tokens if bm.num_query_tokens else 0.0
    out: dict[str, Any] = {"device": device}
    if tiers is not None:
        for name, stats in tiers.stats().items():
            stats["query_tokens"] = stats["query_blocks"] * block_size
            stats["hit_tokens"] = stats["hit_blocks"] * block_size
            out[name] = stats
    return out
