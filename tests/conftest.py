"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.engine.make_tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-initialised llama checkpoint of size tiny (seed 0), shared by the session."""
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny", seed=0)
