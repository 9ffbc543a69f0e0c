"""Paged KV block allocator with reference counts and a prefix cache.

The block manager owns block ids, their reference counts and the ``hash -> block`` map; the
KV tensors themselves belong to the runner. Every block is in exactly one of three states::

    state        ref_count  hash      where
    -----------  ---------  --------  ------------------------------------------------
    free         0          none      _free   (FIFO: fresh ids in order, then as freed)
    evictable    0          set       _evictable (LRU: least recently released first)
    in use       >= 1       maybe     owned by one or more sequences

    free + evictable + in use == num_blocks, and no block is in two places.

Allocation takes free blocks first and only then evicts the least recently released
cached block (dropping its hash). A prefix hit on an evictable block revives it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvrelay.cachetier.block_hash import BlockHash, chain_seed, hash_blocks
from kvrelay.engine.sequence import Sequence


class CacheEvents(NamedTuple):
    """Blocks that entered or left this instance's prefix cache since the last drain."""

    stored: list[tuple[BlockHash, int]]  # (hash, block id); the block may be reused later
    evicted: list[BlockHash]  # hashes cached before the last drain and gone now

    # Net changes: a hash stored and evicted between two drains is in neither list (a
    # consumer applying ``evicted`` then ``stored`` would otherwise keep it forever, and an
    # offload would copy a block id that holds other data by then).


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        fingerprint: bytes = b"",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = fingerprint
        self._ref_count = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        self._stored: dict[BlockHash, int] = {}  # since the last drain, in order
        self._evicted: list[BlockHash] = []
        self.num_evictions = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold ``num_new_tokens`` more computed tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_ids))

    def update_hashes(self, seq: Sequence) -> None:
        """Extends ``seq.block_hashes`` to cover every full block of its tokens."""
        done = len(seq.block_hashes)
        if seq.num_tokens // self.block_size > done:
            parent = seq.block_hashes[-1] if done else None
            adapter = None if seq.lora is None else seq.lora.fingerprint
            seed = chain_seed(self.fingerprint, seq.params.cache_salt, adapter)
            seq.block_hashes.extend(hash_blocks(seq.token_ids, self.block_size, seed, done, parent))

    def find_cached_prefix(
        self, seq: Sequence, filling: Mapping[BlockHash, int] | None = None
    ) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (no side effects on blocks).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed
        so the step that finishes the prompt has logits to sample from. ``filling``: blocks
        that sequences scheduled earlier in the step being planned fill in it
        (:meth:`blocks_filled_by`); they count as cached.
        """
        if not self.enable_prefix_caching or seq.needs_every_prompt_token:
            return []  # prompt logprobs need every prompt token's logits (mean pooling, states)
        self.update_hashes(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:limit]:
            block_id = self._cached.get(block_hash)
            if block_id is None and filling:
                block_id = filling.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def blocks_filled_by(
        self, seq: Sequence, start: int, num_new_tokens: int
    ) -> Iterator[tuple[BlockHash, int]]:
        """The (hash, block id) of each block of ``seq`` that a step computing its tokens
        ``[start, start + num_new_tokens)`` fills, and that is not cached yet.

        A sequence scheduled after ``seq`` in the same step may adopt them as a cached
        prefix: every layer of a step stores all of its rows' K/V in the pool before any
        row's attention reads it, so the adopting rows see the keys and values ``seq``'s
        rows write. A burst of prompts sharing a prefix (a system prompt, a reranker's query
        before each document) computes it once, not once per prompt of the step.
        """
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        last = min((start + num_new_tokens) // self.block_size, len(seq.block_hashes))
        for i in range(start // self.block_size, last):
            block_id = seq.block_ids[i]
            if self._block_hash[block_id] is None:
                yield seq.block_hashes[i], block_id

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached: Seq[int] = (), num_external: int = 0
    ) -> bool:
        """Whether :meth:`allocate` with the same arguments would succeed."""
        num_revived = sum(1 for b in cached if self._ref_count[b] == 0)
        need = self._blocks_needed_after(seq, num_new_tokens, cached, num_external)
        return need <= self.num_free_blocks - num_revived

    # ------------------------------------------------------------------ intents
    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached: Seq[int] = (), num_external: int = 0
    ) -> bool:
        """Gives ``seq`` room for ``num_new_tokens`` more tokens; all or nothing.

        On a sequence's first allocation, ``cached`` (from :meth:`find_cached_prefix`) is
        adopted: its blocks gain a reference and ``seq.num_computed_tokens`` skips them.
        ``num_external`` more blocks after them get fresh ids and count as computed too: the
        caller fills them from a lower cache tier before the step runs.
        Returns False, changing nothing, when there are not enough blocks.
        """
        assert not (cached or num_external) or not seq.block_ids, "prefix only at first"
        if not self.can_allocate(seq, num_new_tokens, cached, num_external):
            return False
        if not seq.block_ids:
            num_hit = len(cached) * self.block_size
            self.num_query_tokens += seq.num_tokens
            self.num_hit_tokens += num_hit
            for block_id in cached:
                self._acquire(block_id)
            seq.block_ids = list(cached)
            seq.num_computed_tokens = num_hit + num_external * self.block_size
            seq.num_cached_tokens = max(seq.num_cached_tokens, num_hit)
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_ids.append(self._take_block())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publishes ``seq``'s fully computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(num_full):
            block_id = seq.block_ids[i]
            if self._block_hash[block_id] is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self._cached:
                continue  # an identical block is cached already; this one stays private
            self._block_hash[block_id] = block_hash
            self._cached[block_hash] = block_id
            self._stored[block_hash] = block_id

    def free(self, seq: Sequence) -> None:
        """Drops ``seq``'s references, tail first so a prefix outlives its suffix in the LRU."""
        self.release(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Gives back ``seq``'s blocks past its computed tokens (a speculative step's rejected
        draft may have reached into them; they were never cached)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.release(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block (for holders that are not sequences)."""
        for block_id in block_ids:
            assert self._ref_count[block_id] > 0, f"block {block_id} freed twice"
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] == 0:
                if self._block_hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def take_blocks(self, num_blocks: int) -> list[int] | None:
        """Takes ``num_blocks`` blocks with one reference each, or None if there are too few."""
        if num_blocks > self.num_free_blocks:
            return None
        return [self._take_block() for _ in range(num_blocks)]

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix cache now (for a full-state event)."""
        return list(self._cached)

    def pop_events(self) -> CacheEvents:
        """Returns and clears the stored/evicted hashes since the last call."""
        events = CacheEvents(list(self._stored.items()), self._evicted)
        self._stored, self._evicted = {}, []
        return events

    def reset_prefix_cache(self) -> int:
        """Forgets every evictable cached block; returns how many were dropped."""
        dropped = list(self._evictable)
        for block_id in dropped:
            self._forget_hash(block_id)
            self._free.append(block_id)
        self._evictable.clear()
        return len(dropped)

    # ------------------------------------------------------------------ internals
    def _blocks_needed_after(
        self, seq: Sequence, num_new: int, cached: Seq[int], num_external: int
    ) -> int:
        if seq.block_ids:
            return self.blocks_needed(seq, num_new)
        prefix = len(cached) + num_external
        total = -(-(prefix * self.block_size + num_new) // self.block_size)
        return max(0, total - len(cached))

    def _acquire(self, block_id: int) -> None:
        if self._ref_count[block_id] == 0:
            del self._evictable[block_id]
        self._ref_count[block_id] += 1

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
            self.num_evictions += 1
        self._ref_count[block_id] = 1
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        assert block_hash is not None
        del self._cached[block_hash]
        self._block_hash[block_id] = None
        if self._stored.pop(block_hash, None) is None:  # stored since the last drain: net zero
            self._evicted.append(block_hash)

    def check_integrity(self) -> None:
        """Raises AssertionError if any invariant in the module docstring is broken."""
        free, evictable = set(self._free), set(self._evictable)
        in_use = {b for b in range(self.num_blocks) if self._ref_count[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free queue"
        assert not (free & evictable) and not (free & in_use) and not (evictable & in_use)
        assert len(free) + len(evictable) + len(in_use) == self.num_blocks, "a block is lost"
        assert all(self._block_hash[b] is None for b in free), "a free block kept its hash"
        assert all(self._block_hash[b] is not None for b in evictable)
        for block_hash, block_id in self._cached.items():
            assert self._block_hash[block_id] == block_hash, f"hash map wrong for {block_id}"
        num_hashed = sum(h is not None for h in self._block_hash)
        assert num_hashed == len(self._cached)

    def num_refs(self) -> int:
        """References held in total (a block shared by two sequences counts twice)."""
        return sum(self._ref_count)

    def num_leaked(self) -> int:
        """Blocks still referenced; zero when no sequence or lease holds any."""
        return sum(1 for r in self._ref_count if r > 0)
