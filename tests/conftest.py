"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvrelay.engine.make_tiny import make_tiny

if TYPE_CHECKING:
    from tests.engine_backend import ApiServer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-initialised llama checkpoint of size tiny (seed 0), shared by the session."""
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="session")
def api_server(tiny_model_dir: Path) -> Iterator[ApiServer]:
    """The HTTP API over a real in-process engine (tiny model), served by uvicorn on a free port.

    Yields an ``ApiServer`` (``base_url``, ``backend``, ``tokenizer``); the served names are
    ``tiny`` and ``tiny-alias``, the admin token ``s3cret`` guards a test route ``/admin/ping``.
    """
    from tests.engine_backend import start_api_server

    server = start_api_server(tiny_model_dir)
    yield server
    server.stop()
