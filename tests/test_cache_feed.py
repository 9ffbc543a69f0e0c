"""The device-cache feed: what the routers' prefix index learns equals what the block
manager holds, however drains (after steps) and sends (on heartbeats) interleave."""

from __future__ import annotations

import random

import pytest

from kvrelay.cachetier.block_hash import hash_blocks
from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.sequence import Sequence
from kvrelay.protocol.messages import CacheEvent
from kvrelay.protocol.sampling_params import SamplingParams
from kvrelay.router.prefix_index import PrefixIndex
from kvrelay.worker.cache_feed import DeviceCacheFeed

BS = 4


def _admit(bm: BlockManager, tokens: list[int], seq_id: str) -> Sequence | None:
    s = Sequence(seq_id, tokens, SamplingParams())
    cached = bm.find_cached_prefix(s)
    num_new = s.num_tokens - len(cached) * BS
    if not bm.allocate(s, num_new, cached):
        return None
    s.num_computed_tokens += num_new
    bm.cache_full_blocks(s)
    return s


def _send(feed: DeviceCacheFeed, index: PrefixIndex) -> None:
    changes = feed.take()
    if changes is not None:
        index.apply("w", CacheEvent("w", *changes))


def test_a_block_stored_and_evicted_between_two_sends_is_not_credited() -> None:
    """Stored in one drain, evicted in the next, both before one heartbeat: the router must
    not go on crediting the block (the old two-list feed reached it as stored)."""
    bm, feed, index = BlockManager(2, BS, fingerprint=b"m"), DeviceCacheFeed(), PrefixIndex()
    first = _admit(bm, list(range(8)), "a")  # 2 blocks, both cached
    assert first is not None
    bm.free(first)
    feed.note(bm.pop_events())  # drain after a step: stored a0, a1
    second = _admit(bm, list(range(100, 108)), "b")  # evicts a0, a1
    assert second is not None
    feed.note(bm.pop_events())  # next step's drain: evicted a0, a1; stored b0, b1
    _send(feed, index)  # one heartbeat for both
    assert index.sizes() == {"w": 2}
    held = index.matched_blocks(hash_blocks(list(range(100, 108)), BS, b"m"))
    assert held == {"w": 2}
    assert index.matched_blocks(hash_blocks(list(range(8)), BS, b"m")) == {}


@pytest.mark.parametrize("seed", range(20))
def test_the_index_equals_the_block_manager_after_any_interleaving(seed: int) -> None:
    rng = random.Random(seed)
    bm, feed, index = BlockManager(12, BS, fingerprint=b"m"), DeviceCacheFeed(), PrefixIndex()
    prompts = [[p * 1000 + t for t in range(rng.randrange(4, 24))] for p in range(10)]
    running: list[Sequence] = []
    for step in range(300):
        action = rng.random()
        if action < 0.45:
            prompt = rng.choice(prompts)
            s = _admit(bm, prompt[: rng.randrange(4, len(prompt) + 1)], f"s{step}")
            if s is not None:
                running.append(s)
        elif action < 0.8 and running:
            bm.free(running.pop(rng.randrange(len(running))))
        elif action < 0.95:
            feed.note(bm.pop_events())
        else:
            _send(feed, index)
        bm.check_integrity()
    feed.note(bm.pop_events())
    _send(feed, index)
    expected = {bytes(key) for key in bm.cached_hashes()}
    assert index.sizes().get("w", 0) == len(expected)
    for key in expected:
        assert index.matched_blocks([key]) == {"w": 1}
