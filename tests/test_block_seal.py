"""BlockSealer: what a keyed reader accepts (only its own, untampered values) and rejects."""

from __future__ import annotations

import numpy as np
import pytest

from kvrelay.cachetier.base import HEADER_BYTES, BlockFormat, CorruptBlock, pack_header
from kvrelay.cachetier.block_hash import BlockHash, hash_blocks
from kvrelay.cachetier.block_seal import BlockSealer, Seal
from kvrelay.protocol.credential import ClusterCredential

FMT = BlockFormat(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
CRED = ClusterCredential(bytes(range(32)))
KEYS = hash_blocks(list(range(12)), FMT.block_size, b"fp")


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, FMT.payload_bytes, dtype=np.uint8)


def sealed(sealer: BlockSealer, key: BlockHash, data: np.ndarray) -> bytes:
    buf = bytearray(sealer.value_bytes)
    start = sealer.payload_offset
    buf[start : start + FMT.payload_bytes] = data.tobytes()
    return bytes(sealer.seal_value(key, buf))


def reason(sealer: BlockSealer, key: BlockHash, value: bytes) -> str:
    with pytest.raises(CorruptBlock) as info:
        sealer.open_value(key, value)
    return info.value.reason


@pytest.mark.parametrize("encrypt", [False, True])
def test_round_trip_and_tamper(encrypt: bool) -> None:
    sealer = BlockSealer(FMT, CRED, encrypt)
    assert sealer.seal is (Seal.AEAD if encrypt else Seal.MAC)
    data = payload(1)
    value = sealed(sealer, KEYS[0], data)
    assert len(value) == sealer.value_bytes
    assert bytes(sealer.open_value(KEYS[0], value)) == data.tobytes()
    bad = "decrypt_failed" if encrypt else "bad_mac"

    flipped = bytearray(value)
    flipped[HEADER_BYTES + 40] ^= 1
    assert reason(sealer, KEYS[0], bytes(flipped)) == bad
    # Replay under another key: as stored (the header names the first key), and with the
    # header's key rewritten (then the tag, which covers the key, fails).
    assert reason(sealer, KEYS[1], value) == "bad_header"
    moved = pack_header(FMT, KEYS[1], None, sealer.seal.value) + value[HEADER_BYTES:]
    assert reason(sealer, KEYS[1], moved) == bad
    # Another cluster's key.
    other = BlockSealer(FMT, ClusterCredential.generate(), encrypt)
    assert reason(other, KEYS[0], value) == bad


@pytest.mark.parametrize("encrypt", [False, True])
def test_keyed_reader_rejects_unkeyed_and_other_seal(encrypt: bool) -> None:
    sealer = BlockSealer(FMT, CRED, encrypt)
    noise = payload(2)
    forged = pack_header(FMT, KEYS[0], noise) + noise.tobytes()  # today's format, valid xxh3
    assert BlockSealer(FMT, None, False).open_value(KEYS[0], forged) is not None
    assert reason(sealer, KEYS[0], forged) == "unkeyed"
    other_seal = sealed(BlockSealer(FMT, CRED, not encrypt), KEYS[0], payload(3))
    assert reason(sealer, KEYS[0], other_seal) == "wrong_seal"
    assert reason(BlockSealer(FMT, None, False), KEYS[0], other_seal) == "wrong_seal"


def test_ciphertext_holds_no_run_of_the_payload() -> None:
    sealer = BlockSealer(FMT, CRED, encrypt=True)
    data = payload(4).tobytes()
    a, b = sealed(sealer, KEYS[0], payload(4)), sealed(sealer, KEYS[0], payload(4))
    assert a != b  # a fresh nonce per write
    for value in (a, b):
        assert not any(data[i : i + 32] in value for i in range(0, len(data) - 32, 16))


def test_encrypt_needs_a_credential() -> None:
    with pytest.raises(ValueError, match="cluster secret"):
        BlockSealer(FMT, None, encrypt=True)
