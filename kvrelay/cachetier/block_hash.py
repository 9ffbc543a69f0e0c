"""Chained 128-bit block hashes: the one key that names a KV block in every tier and host.

``h_i = blake2b-128(h_{i-1} || seed || tokens of block i)``. The chain makes a block's
key depend on every token before it, so equal keys mean equal KV. The seed
(``chain_seed``) is the model fingerprint
(``identity.model_identity``: every byte of the weights, config and tokenizer files, and the
dtype), which keeps two models (or two tokenizers) from
ever sharing an entry, followed by a digest of the request's ``cache_salt`` when it has one:
requests share cached prefixes (device, L1, L2, the router's placement index) only with
requests of the same salt, so one tenant cannot learn by timing what another sent; then, for
a request served through a LoRA adapter, a tag and the adapter's identity
(``engine.lora.adapter_identity``): KV computed under one adapter is another model's KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""16 bytes; a typed value, never a joined string."""

HASH_BYTES = 16
_ROOT = b"\x00" * HASH_BYTES


_LORA_TAG = b"lora"


def chain_seed(fingerprint: bytes, cache_salt: str | None, adapter: bytes | None = None) -> bytes:
    """What every block hash of a request mixes in: the fingerprint, then the salt's digest,
    then the LoRA adapter's tagged identity. Every part has a fixed length, so the seed's
    length tells which are present and no two (fingerprint, salt, adapter) triples collide;
    the seed of a request with neither is the fingerprint alone, as before adapters."""
    seed = fingerprint
    if cache_salt is not None:
        salt = hashlib.blake2b(cache_salt.encode(), digest_size=HASH_BYTES, person=b"kvrelay-salt")
        seed += salt.digest()
    if adapter is not None:
        if len(adapter) != HASH_BYTES:
            raise ValueError(f"an adapter identity is {HASH_BYTES} bytes, got {len(adapter)}")
        seed += _LORA_TAG + adapter
    return seed


def hash_block(parent: BlockHash | None, fingerprint: bytes, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else _ROOT)
    h.update(fingerprint)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return BlockHash(h.digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: bytes,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` when ``start > 0``.
    """
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, fingerprint, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
