"""Sealed blocks: the stored form of a KV block that leaves the process (the L2 tier).

A tier anyone else can write (Redis: every client with its password, its operator, a
replica) is outside the trust boundary. A block read back from it is used as KV only if it
carries a valid tag under the cluster's key (``ClusterCredential.derive_key``), computed
over the header, the block's key and the payload, so a forged payload, a block moved to
another key and a block from another cluster all fail. Three forms, one per ``Seal``::

    unkeyed  header(seal 0, xxh3 of payload) | payload                  no credential
    mac      header(seal 1)  | payload | HMAC-SHA256(k_mac, key|header|payload)  32 bytes
    aead     header(seal 2)  | nonce (12, random) | AES-256-GCM(k_aead, payload,
                                                       ad = key|header) | tag (16)

A reader accepts only its own form: a reader holding a key rejects an unkeyed value (and a
MAC value when it encrypts, an encrypted one when it does not), so nobody downgrades a
keyed cluster by writing the old format. The header stays in the clear (it says what the
value is; it is authenticated). Costs per block of SmolLM2-135M (720 KiB): BENCHMARKS.md.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from typing import TYPE_CHECKING

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvrelay.cachetier.base import (
    HEADER_BYTES,
    SEAL_AEAD,
    SEAL_CHECKSUM,
    SEAL_MAC,
    BlockFormat,
    CorruptBlock,
    check_header,
    check_value,
    key_bytes,
    pack_header,
)
from kvrelay.cachetier.block_hash import BlockHash

if TYPE_CHECKING:
    from kvrelay.protocol.credential import ClusterCredential

MAC_BYTES = 32
NONCE_BYTES = 12
AEAD_TAG_BYTES = 16


class Seal(enum.Enum):
    UNKEYED = SEAL_CHECKSUM  # no credential: integrity against accidents only
    MAC = SEAL_MAC  # keyed integrity; the payload is readable by whoever reads the store
    AEAD = SEAL_AEAD  # keyed integrity and confidentiality


_TRAILER = {Seal.UNKEYED: 0, Seal.MAC: MAC_BYTES, Seal.AEAD: NONCE_BYTES + AEAD_TAG_BYTES}


class BlockSealer:
    """Seals and opens the stored values of one block format under one key (or none).

    Thread-safe (no mutable state); the writer thread seals while the loop thread opens.

    Args:
        fmt: the block format; a value of another format fails as ``bad_header``.
        credential: the cluster credential; None: unkeyed values (a trusted network only).
        encrypt: AEAD instead of a MAC (needs ``credential``).
    """

    def __init__(
        self, fmt: BlockFormat, credential: ClusterCredential | None, encrypt: bool
    ) -> None:
        if encrypt and credential is None:
            raise ValueError("encrypting L2 blocks needs the cluster secret (its l2-aead key)")
        self.fmt = fmt
        self.seal = Seal.UNKEYED if credential is None else Seal.AEAD if encrypt else Seal.MAC
        self._mac_key = b"" if credential is None else credential.derive_key("l2-mac")
        self._aead = None if credential is None else AESGCM(credential.derive_key("l2-aead"))
        self.value_bytes = HEADER_BYTES + fmt.payload_bytes + _TRAILER[self.seal]

    @property
    def payload_offset(self) -> int:
        """Where ``seal`` expects the payload in its buffer (after the header, and the nonce
        when encrypting)."""
        return HEADER_BYTES + (NONCE_BYTES if self.seal is Seal.AEAD else 0)

    def seal_value(self, key: BlockHash, buf: bytearray) -> bytearray:
        """Seals the payload at ``buf[payload_offset:][:payload_bytes]`` in place and returns
        ``buf``, now the stored value (``value_bytes`` long: header, trailer and, when
        encrypting, the nonce and ciphertext are written into it)."""
        view = memoryview(buf)
        end = HEADER_BYTES + self.fmt.payload_bytes
        if self.seal is Seal.UNKEYED:
            view[:HEADER_BYTES] = pack_header(self.fmt, key, view[HEADER_BYTES:end])
            return buf
        header = pack_header(self.fmt, key, None, self.seal.value)
        view[:HEADER_BYTES] = header
        if self.seal is Seal.MAC:
            view[end:] = self._mac(key, view[:end])
            return buf
        assert self._aead is not None
        start = self.payload_offset
        nonce = secrets.token_bytes(NONCE_BYTES)
        view[HEADER_BYTES:start] = nonce
        payload = view[start : start + self.fmt.payload_bytes]
        self._aead.encrypt_into(nonce, payload, key_bytes(key) + header, view[start:])
        return buf

    def open_value(self, key: BlockHash, value: bytes | memoryview) -> np.ndarray:
        """A fresh copy (uint8, owned by the caller) of the payload of ``value`` stored under
        ``key``; raises CorruptBlock (with a reason) for a value of another format, key or
        seal, or one whose tag does not verify."""
        buf = memoryview(value).cast("B")
        if len(buf) < HEADER_BYTES:
            raise CorruptBlock(f"value is {len(buf)} bytes, shorter than a header")
        seal, _ = check_header(self.fmt, key, buf[:HEADER_BYTES])
        if seal != self.seal.value:
            reason = "unkeyed" if seal == SEAL_CHECKSUM else "wrong_seal"
            raise CorruptBlock(f"seal {seal}, this reader expects {self.seal.name}", reason)
        if len(buf) != self.value_bytes:
            raise CorruptBlock(f"value is {len(buf)} bytes, expected {self.value_bytes}")
        if self.seal is Seal.UNKEYED:
            return np.frombuffer(check_value(self.fmt, key, buf), dtype=np.uint8).copy()
        end = HEADER_BYTES + self.fmt.payload_bytes
        if self.seal is Seal.MAC:
            if not hmac.compare_digest(self._mac(key, buf[:end]), buf[end:]):
                raise CorruptBlock("MAC does not verify", "bad_mac")
            return np.frombuffer(buf[HEADER_BYTES:end], dtype=np.uint8).copy()
        assert self._aead is not None
        nonce = bytes(buf[HEADER_BYTES : self.payload_offset])
        ad = key_bytes(key) + bytes(buf[:HEADER_BYTES])
        out = np.empty(self.fmt.payload_bytes, dtype=np.uint8)
        try:
            self._aead.decrypt_into(nonce, buf[self.payload_offset :], ad, out.data)
        except InvalidTag:
            raise CorruptBlock("AEAD tag does not verify", "decrypt_failed") from None
        return out

    def _mac(self, key: BlockHash, header_and_payload: memoryview) -> bytes:
        mac = hmac.new(self._mac_key, key_bytes(key), "sha256")
        mac.update(header_and_payload)
        return mac.digest()
