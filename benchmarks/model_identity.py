"""What the full model identity costs: hashing every byte, cold and cached, and `kvrelay up`'s
start-to-first-token before and after it.

Usage::

    python benchmarks/model_identity.py [--model DIR] [--base-tree DIR] [--repeats N]

``--model``: a checkpoint (default ``/work/cache/models/smollm2-hf`` if present) and always a
make-tiny ``medium`` one written here. ``--base-tree``: a source tree of the code before
(``git archive <commit> | tar -x -C DIR``) for the start-to-first-token comparison; without
it only the identity costs are measured. Writes the ``## Model identity`` section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    REPO_ROOT,
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    median,
    up_first_token_s,
    update_benchmarks_md,
)
from scale_up_setup import evict_page_cache

SMOLLM = Path("/work/cache/models/smollm2-hf")
NOTES = (
    "Every byte of the weight, config and tokenizer files (`identity.identity_files`), one "
    "thread of the caller plus blake3's own pool over a memory map; medians. 'no digest "
    "cache': a fresh `KVRELAY_CACHE_DIR` and no `kvrelay-identity.json` (a first start on a "
    "host); 'from kvrelay-identity.json': a fresh cache, digests from the record "
    "`make-tiny` wrote; 'cached': the digest cache filled (every later start: stat calls "
    "only). 'page cache evicted': `posix_fadvise(DONTNEED)` first. In `kvrelay up` below, "
    "'digest cache empty' hashes the weights for smollm2-hf but reads the record for "
    "make-tiny's checkpoint."
)


def _hash_all(model_dir: Path, algo: str) -> None:
    from kvrelay.engine.identity import identity_files

    for path in identity_files(model_dir):
        if algo == "blake3":
            import blake3

            blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).digest()
        else:
            with path.open("rb") as f:
                hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=32))


def measure_identity(model_dir: Path, repeats: int) -> dict[str, float]:
    """Seconds (medians): blake2b and blake3 over every file, page cache warm and evicted;
    ``model_identity`` with an empty digest cache and with a filled one."""
    from kvrelay.engine.identity import IDENTITY_FILE, identity_files, model_identity

    out: dict[str, float] = {"mib": sum(p.stat().st_size for p in identity_files(model_dir))}
    out["mib"] /= 2**20
    for algo in ("blake2b", "blake3"):
        _hash_all(model_dir, algo)  # page cache warm
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _hash_all(model_dir, algo)
            times.append(time.perf_counter() - start)
        out[f"{algo}_warm_s"] = median(times)
    evicted = []
    for _ in range(repeats):
        evict_page_cache(model_dir)
        start = time.perf_counter()
        _hash_all(model_dir, "blake3")
        evicted.append(time.perf_counter() - start)
    out["blake3_evicted_s"] = median(evicted)
    cold, recorded, cached = [], [], []
    record = model_dir / IDENTITY_FILE
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["KVRELAY_CACHE_DIR"] = cache
            if record.is_file():  # digests from the directory's record: no hashing
                start = time.perf_counter()
                model_identity(model_dir, "float32")
                recorded.append(time.perf_counter() - start)
                shutil.rmtree(cache)
            hidden = record.rename(record.with_suffix(".aside")) if record.is_file() else None
            try:
                start = time.perf_counter()
                model_identity(model_dir, "float32")
                cold.append(time.perf_counter() - start)
            finally:
                if hidden is not None:
                    hidden.rename(record)
            start = time.perf_counter()
            model_identity(model_dir, "float32")
            cached.append(time.perf_counter() - start)
    out["identity_cold_s"], out["identity_cached_s"] = median(cold), median(cached)
    out["identity_recorded_s"] = median(recorded) if recorded else float("nan")
    return out


def _first_token_s(tree: Path, model_dir: Path, cache: Path, log_dir: Path) -> float:
    """Seconds from starting ``kvrelay up`` (code of ``tree``) to a 1-token completion."""
    args = ["--threads", "1", "--num-blocks", "256"]
    return up_first_token_s(tree, model_dir, log_dir, args, {"KVRELAY_CACHE_DIR": str(cache)})


def measure_up(base: Path, model_dir: Path, repeats: int, work: Path) -> dict[str, float]:
    """Median start-to-first-token: before, after (digests cached), after (cache empty).
    One unmeasured start of each tree first: it builds that tree's parameter pool."""
    cache = work / "cache"
    runs: dict[str, list[float]] = {"before": [], "after_cached": [], "after_cold": []}
    for tree in (base, REPO_ROOT):
        _first_token_s(tree, model_dir, cache, work / "logs")
    for i in range(repeats):
        runs["before"].append(_first_token_s(base, model_dir, cache, work / f"logs{i}b"))
        runs["after_cached"].append(_first_token_s(REPO_ROOT, model_dir, cache, work / f"l{i}a"))
        shutil.rmtree(cache, ignore_errors=True)
        runs["after_cold"].append(_first_token_s(REPO_ROOT, model_dir, cache, work / f"l{i}c"))
    return {k: median(v) for k, v in runs.items()}


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e3:.2f}"  # NaN: not measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMOLLM if SMOLLM.is_dir() else None)
    parser.add_argument("--base-tree", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--up-repeats", type=int, default=3)
    args = parser.parse_args()
    from kvrelay.cachetier import param_ops
    from kvrelay.engine.make_tiny import make_tiny

    shm_before = {p.name for p in param_ops.list_pools()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {"make-tiny medium": make_tiny(work / "medium", size="medium")}
        if args.model is not None:
            models[args.model.name] = args.model
        time.sleep(1.1)  # past the "racy" second: digests of the new files are cached
        ident = {name: measure_identity(path, args.repeats) for name, path in models.items()}
        up = {}
        if args.base_tree is not None:
            for name, path in models.items():
                up[name] = measure_up(args.base_tree, path, args.up_repeats, work / name)
        for info in param_ops.list_pools():
            if info.name not in shm_before and not info.user_pids:
                param_ops.remove(info.name)
    rows = [
        [name, f"{r['mib']:.0f}", f"{r['blake2b_warm_s']:.3f}", f"{r['blake3_warm_s']:.3f}",
         f"{r['blake3_evicted_s']:.3f}", f"{r['identity_cold_s']:.3f}",
         _ms(r["identity_recorded_s"]), _ms(r["identity_cached_s"])]
        for name, r in ident.items()
    ]  # fmt: skip
    body = machine_markdown(machine_info(1)) + "\n\n" + NOTES + "\n\n" + markdown_table(
        ["model", "MiB hashed", "blake2b (s)", "blake3 (s)", "blake3, page cache evicted (s)",
         "model_identity, no digest cache (s)", "from kvrelay-identity.json (ms)",
         "model_identity, cached (ms)"], rows,
    )  # fmt: skip
    if up:
        up_rows = [
            [name, f"{r['before']:.2f}", f"{r['after_cached']:.2f}",
             f"{(r['after_cached'] / r['before'] - 1) * 100:+.1f}%", f"{r['after_cold']:.2f}",
             f"{(r['after_cold'] / r['before'] - 1) * 100:+.1f}%"]
            for name, r in up.items()
        ]  # fmt: skip
        body += "\n\n`kvrelay up` (1 prefill + 1 decode, parameter pool ready) start to first "
        body += f"token, median of {args.up_repeats}, before and after alternating:\n\n"
        body += markdown_table(
            ["model", "before (s)", "after, digests cached (s)", "change",
             "after, digest cache empty (s)", "change"], up_rows,
        )  # fmt: skip
    update_benchmarks_md("Model identity", body, command_line(__file__))
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
