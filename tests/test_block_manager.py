"""Block manager: exact block ids, ref counts, eviction order; integrity after every case."""

from __future__ import annotations

import pytest

from kvrelay.cachetier.block_hash import hash_block, hash_blocks
from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.sequence import Sequence
from kvrelay.protocol.sampling_params import SamplingParams

BS = 4


def seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Admits ``s`` for its whole prompt, as the scheduler does; returns the hit blocks."""
    cached = bm.find_cached_prefix(s)
    num_new = s.num_tokens - len(cached) * BS
    assert bm.allocate(s, num_new, cached)
    s.num_computed_tokens += num_new
    bm.cache_full_blocks(s)
    return cached


@pytest.fixture
def bm():
    manager = BlockManager(num_blocks=8, block_size=BS, fingerprint=b"model-a")
    yield manager
    manager.check_integrity()


def test_fresh_blocks_are_handed_out_in_id_order(bm):
    a, b = seq("a", range(10)), seq("b", range(100, 105))
    admit(bm, a)
    admit(bm, b)
    assert a.block_ids == [0, 1, 2]
    assert b.block_ids == [3, 4]
    assert bm.num_free_blocks == 3
    assert bm.num_cached_blocks == 3  # a: 2 full blocks, b: 1 full block


def test_allocate_is_all_or_nothing(bm):
    big = seq("big", range(40))
    assert not bm.can_allocate(big, 40)
    assert not bm.allocate(big, 40)
    assert big.block_ids == [] and bm.num_free_blocks == 8


def test_growth_adds_a_block_only_at_a_boundary(bm):
    s = seq("s", range(7))
    admit(bm, s)
    assert s.block_ids == [0, 1]
    s.token_ids.append(7)
    assert bm.blocks_needed(s, 1) == 0
    s.num_computed_tokens += 1
    s.token_ids.append(8)
    assert bm.blocks_needed(s, 1) == 1
    assert bm.allocate(s, 1)
    assert s.block_ids == [0, 1, 2]


def test_prefix_hit_shares_blocks_and_counts_refs(bm):
    a = seq("a", range(13))
    admit(bm, a)
    b = seq("b", [*range(8), 50, 51, 52, 53, 54])
    hits = admit(bm, b)
    assert hits == [0, 1]
    assert b.block_ids == [0, 1, 4, 5]
    assert b.num_cached_tokens == 8
    bm.free(a)
    # blocks 0 and 1 are still used by b; a's private blocks 2, 3 are released
    assert bm.num_free_blocks == 4
    bm.free(b)
    assert bm.num_leaked() == 0


def test_last_token_is_never_a_hit(bm):
    a = seq("a", range(8))
    admit(bm, a)
    same = seq("same", range(8))
    assert bm.find_cached_prefix(same) == [0]  # block 1 would leave no token to compute


def test_eviction_takes_free_blocks_first_then_lru(bm):
    a = seq("a", range(8))  # 2 full blocks: 0, 1
    b = seq("b", range(100, 108))  # 2 full blocks: 2, 3
    admit(bm, a)
    admit(bm, b)
    assert (hash_blocks(list(range(8)), BS, b"model-a")[0], 0) in bm.pop_events().stored
    bm.free(a)  # releases 1 then 0: LRU order 1, 0
    bm.free(b)  # then 3, 2
    c = seq("c", range(200, 220))  # needs 5 blocks: free 4..7, then evict 1
    admit(bm, c)
    assert c.block_ids == [4, 5, 6, 7, 1]
    assert bm.num_evictions == 1
    events = bm.pop_events()
    assert hash_blocks(list(range(8)), BS, b"model-a")[1] in events.evicted
    # a's first block survived: a prefix outlives its suffix
    again = seq("again", range(9))
    assert bm.find_cached_prefix(again) == [0]


def test_events_are_net_changes_between_drains(bm):
    """A block cached and evicted between two drains is reported in neither list; one that
    was reported, evicted and cached again is reported both ways (evicted, then stored)."""
    a_keys = hash_blocks(list(range(8)), BS, b"model-a")
    b_keys = hash_blocks(list(range(100, 112)), BS, b"model-a")
    c_keys = hash_blocks(list(range(200, 224)), BS, b"model-a")
    a = seq("a", range(8))  # blocks 0, 1
    admit(bm, a)
    bm.free(a)  # LRU: 1, 0
    assert [key for key, _ in bm.pop_events().stored] == a_keys
    b = seq("b", range(100, 112))  # blocks 2, 3, 4
    admit(bm, b)
    bm.free(b)  # LRU: 1, 0, 4, 3, 2
    c = seq("c", range(200, 224))  # 6 blocks: free 5..7, then evict 1, 0 (a's) and 4 (b's)
    admit(bm, c)
    assert c.block_ids == [5, 6, 7, 1, 0, 4]
    events = bm.pop_events()
    assert events.evicted == [a_keys[1], a_keys[0]]  # b's block 4 came and went: not there
    assert [key for key, _ in events.stored] == [*b_keys[:2], *c_keys]
    bm.free(c)
    admit(bm, seq("again", range(8)))  # a's blocks are cached again, in other block ids
    events = bm.pop_events()
    assert [key for key, _ in events.stored] == a_keys
    assert events.evicted == [b_keys[1], b_keys[0]]  # reported before, so reported now
    bm.check_integrity()


def test_hit_revives_an_evictable_block(bm):
    a = seq("a", range(9))
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = seq("b", range(9))
    hits = admit(bm, b)
    assert hits == [0, 1]
    assert b.block_ids == [0, 1, 3]  # block 2 (a's partial block) went back to the free queue
    assert bm.num_free_blocks == 5


def test_fingerprint_separates_models():
    tokens = list(range(4))
    assert hash_block(None, b"model-a", tokens) != hash_block(None, b"model-b", tokens)
    chain = hash_blocks(list(range(8)), 4, b"m")
    assert chain[1] == hash_block(chain[0], b"m", [4, 5, 6, 7])
    assert len(chain[0]) == 16


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = seq("a", range(9))
    admit(bm, a)
    bm.free(a)
    assert bm.find_cached_prefix(seq("b", range(9))) == []
    assert bm.num_cached_blocks == 0
    bm.check_integrity()


def test_double_free_is_caught(bm):
    block_ids = bm.take_blocks(2)
    assert block_ids == [0, 1]
    bm.release(block_ids)
    with pytest.raises(AssertionError):
        bm.release([0])
    bm._ref_count[0] = 0  # undo the damage so the fixture's integrity check is meaningful


def test_reset_prefix_cache_frees_evictable_blocks(bm):
    a = seq("a", range(8))
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
