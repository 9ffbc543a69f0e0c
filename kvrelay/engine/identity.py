"""A checkpoint's identity: a digest of every byte that changes what the model computes.

``model_identity(dir, dtype)`` keys everything that may only be shared between equal models:
the parameter pool's name and manifest, the block-hash chain (so KV blocks in the device cache,
the host pool, Redis and the router's prefix index), and the KV hand-off check. It covers::

    identity = blake3-128(DOMAIN, CONVERSION, dtype,
                          for each file (sorted by name): name, size, blake3-256(file bytes))

over the weight files (``model.safetensors`` or the shards of its index), the index, every
top-level ``*.json`` (config, generation config, tokenizer, tokenizer config, special tokens,
added tokens, chat template), ``*.jinja`` chat templates and the other tokenizer files
(``TOKENIZER_FILES``) -- every byte, never samples. ``CONVERSION`` names what
``loader.prepare_weights`` does to the tensors: change that code, bump it.

A file's digest is cached under ``<KVRELAY_CACHE_DIR>/identity/`` keyed by
``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``, so a restart hashes nothing. The
ctime is the guard: a file rewritten in place with its mtime set back by ``os.utime`` still
gets a new ctime (user space cannot set it), so its digest is recomputed. As git's "racy"
rule, a file changed less than a second ago is hashed but not cached: timestamps come from
a coarse clock, so two writes within one tick could share a ctime. A directory kvrelay
wrote (``record_identity``) also carries ``IDENTITY_FILE``: the same per-file entries,
trusted under the same key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import blake3

logger = logging.getLogger(__name__)

IDENTITY_FILE = "kvrelay-identity.json"
DOMAIN = b"kvrelay-model-identity-v1\0"
CONVERSION = b"llama-hf-to-runtime-v1\0"  # loader.prepare_weights: fused qkv/gate_up, [in, out]
TOKENIZER_FILES = ("tokenizer.model", "merges.txt", "vocab.txt", "vocab.json")
_IDENTITY_SUFFIXES = (".json", ".jinja")
_DIGEST_BYTES = 32
_RACY_NS = 1_000_000_000  # a file changed this recently may change again within one ctime tick


class CheckpointError(ValueError):
    """A checkpoint directory that is missing files or tensors kvrelay needs."""


class FileKey(NamedTuple):
    """What changes when a file's bytes may have: ctime cannot be set back from user space."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileKey:
        st = path.stat()
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def cache_name(self) -> str:
        text = "-".join(map(str, self))
        return blake3.blake3(text.encode()).hexdigest(length=20)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"missing file(s) named by {index}: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"missing file: {single} (or model.safetensors.index.json) in {model_dir}"
    )


def identity_files(model_dir: str | Path) -> list[Path]:
    """Every file the identity covers, sorted by name (see the module docstring)."""
    model_dir = Path(model_dir)
    files = set(weight_files(model_dir))
    for path in model_dir.iterdir():
        name = path.name
        is_text = name.endswith(_IDENTITY_SUFFIXES) or name in TOKENIZER_FILES
        if is_text and name != IDENTITY_FILE and path.is_file():
            files.add(path)
    return sorted(files, key=lambda p: p.relative_to(model_dir).as_posix())


def file_digest(path: Path) -> bytes:
    """blake3-256 of every byte of ``path`` (memory-mapped; multi-threaded for large files)."""
    if path.stat().st_size == 0:
        return blake3.blake3().digest(_DIGEST_BYTES)
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    return hasher.update_mmap(path).digest(_DIGEST_BYTES)


def cache_dir() -> Path:
    """Where file digests are cached: ``$KVRELAY_CACHE_DIR/identity``."""
    from kvrelay import envs

    return Path(envs.get("KVRELAY_CACHE_DIR")).expanduser() / "identity"


def cached_file_digest(path: Path, recorded: dict[str, str] | None = None) -> bytes:
    """``file_digest(path)``, from the cache when the file's ``FileKey`` is unchanged.

    Args:
        recorded: cache name -> hex digest from the directory's ``IDENTITY_FILE``.
    """
    key = FileKey.of(path)
    entry = cache_dir() / key.cache_name()
    with contextlib.suppress(OSError, ValueError):
        return bytes.fromhex(entry.read_text().strip())
    digest = None
    if recorded and key.cache_name() in recorded:
        with contextlib.suppress(ValueError):
            digest = bytes.fromhex(recorded[key.cache_name()])
    if digest is None or len(digest) != _DIGEST_BYTES:
        started = time.perf_counter()
        digest = file_digest(path)
        logger.info("hashed %s (%.1f MiB) in %.2f s", path, key.size / 2**20,
                    time.perf_counter() - started)  # fmt: skip
    is_settled = time.time_ns() - max(key.mtime_ns, key.ctime_ns) > _RACY_NS
    if is_settled and FileKey.of(path) == key:  # not changed while hashing, nor too recent
        _write_atomic(entry, digest.hex())
    return digest


def combine(dtype: str, files: Iterable[tuple[str, int, bytes]]) -> bytes:
    """The 16-byte identity of ``(name, size, digest)`` per file, for weights in ``dtype``."""
    h = blake3.blake3(DOMAIN + CONVERSION + dtype.encode() + b"\0")
    for name, size, digest in files:
        h.update(name.encode() + b"\0" + size.to_bytes(8, "little") + digest)
    return h.digest(16)


def model_identity(model_dir: str | Path, dtype: str) -> bytes:
    """The 16-byte identity of the checkpoint in ``model_dir`` served in ``dtype``.

    Raises:
        CheckpointError: the directory has no weights.
    """
    model_dir = Path(model_dir)
    recorded = _read_recorded(model_dir)
    entries = []
    for path in identity_files(model_dir):
        size = path.stat().st_size
        entries.append((path.name, size, cached_file_digest(path, recorded)))
    return combine(dtype, entries)


def record_identity(model_dir: str | Path, dtype: str = "float32") -> bytes:
    """Writes ``IDENTITY_FILE`` into a directory kvrelay wrote, returns its identity in ``dtype``.

    Call it last, after every file is written (``make-tiny``, ``model get``, ``import-gguf``):
    the per-file entries are keyed by ``FileKey``, so an entry whose file changed afterwards
    is ignored, never trusted.
    """
    model_dir = Path(model_dir)
    files: dict[str, dict[str, object]] = {}
    for path in identity_files(model_dir):
        key = FileKey.of(path)
        digest = cached_file_digest(path)
        files[path.name] = {"key": key.cache_name(), "size": key.size, "blake3": digest.hex()}
    identity = model_identity(model_dir, dtype)
    record = {"version": 1, "dtype": dtype, "identity": identity.hex(), "files": files}
    _write_atomic(model_dir / IDENTITY_FILE, json.dumps(record, indent=2, sort_keys=True))
    return identity


def _read_recorded(model_dir: Path) -> dict[str, str]:
    """Cache name -> hex digest from ``IDENTITY_FILE``; {} if absent or unreadable."""
    try:
        files = json.loads((model_dir / IDENTITY_FILE).read_text())["files"]
        return {str(f["key"]): str(f["blake3"]) for f in files.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            logger.warning("ignoring %s: %s", model_dir / IDENTITY_FILE, exc)
        return {}


def _write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` via a temporary file and a rename; a failure is logged."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot write %s: %s", path, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
