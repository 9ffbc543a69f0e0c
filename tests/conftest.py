"""Shared fixtures."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Without a GPU, the Triton kernels run on CPU tensors in Triton's interpreter
# (tests/test_triton_attention.py); that is decided when triton is first imported.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The workers the tests start build xgrammar's tables on the first structured request, not on a
# thread at start: ~2.5 s of CPU each (the import of transformers), in hundreds of starts, most
# of which never see a structured request. test_warm_up.py checks the default (a thread at start).
os.environ.setdefault("KVRELAY_GRAMMAR_WARM_UP", "0")

from kvrelay.engine.make_tiny import make_tiny

if TYPE_CHECKING:
    from tests.engine_backend import ApiServer

_SHM = Path("/dev/shm")
_SHM_BEFORE = pytest.StashKey[set[str]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Notes the shared memory that exists before the run (``pytest_sessionfinish``)."""
    session.config.stash[_SHM_BEFORE] = set(os.listdir(_SHM)) if _SHM.is_dir() else set()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Frees the per-host pools that test processes created under default names.

    Workers started with default options (``tests/test_deploy.py`` runs compose's commands)
    use the host's L1 pool (``kvrelay-l1-host-*``) and parameter pools (``kvrelay-params-*``),
    which outlive their processes on purpose. Pools that existed before the session, and any
    a live process still maps or uses, are left alone; so are the per-test pools
    (``kvrelay-l1-test-*``), which their fixtures remove: another test session on the same
    machine may be between two opens of one (nothing maps it then) when this one ends.

    Under pytest-xdist only the controlling process frees them, once every worker is done: a
    worker that finished first could otherwise remove a pool another worker's test is
    between two opens of.
    """
    if hasattr(session.config, "workerinput") or not _SHM.is_dir():
        return  # an xdist worker: the controller frees them
    from kvrelay.cachetier import host_ops, param_locks, param_ops

    before = session.config.stash.get(_SHM_BEFORE, set())
    log = logging.getLogger(__name__)
    for name in sorted(set(os.listdir(_SHM)) - before):
        if name.endswith(".lock") or name.startswith("kvrelay-l1-test-"):
            continue
        try:
            if name.startswith("kvrelay-l1-"):
                host_ops.remove_host_pool(name)
            elif name.startswith(param_ops.PREFIX):
                param_ops.remove(name)
        except (host_ops.PoolInUse, param_locks.PoolBusy, ValueError) as exc:
            log.warning("left %s in %s: %s", name, _SHM, exc)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-initialised llama checkpoint of size tiny (seed 0), shared by the session."""
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="session")
def stream_reference(tiny_model_dir: Path) -> str:
    """The tiny model's greedy text for ``cluster_harness.STREAM_PROMPT`` (STREAM_TOKENS
    tokens, offline): what a cluster's interrupted and resumed stream must still read."""
    from kvrelay import LLM, SamplingParams
    from tests.cluster_harness import STREAM_PROMPT, STREAM_TOKENS

    llm = LLM(str(tiny_model_dir), num_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    return llm.generate(STREAM_PROMPT, params)[0].outputs[0].text


@pytest.fixture(scope="session")
def real_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF, downloaded once per machine (``tests/real_model.py``)."""
    from tests.real_model import real_gguf

    return real_gguf()


@pytest.fixture(scope="session")
def real_model_dir(real_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``real_gguf_path`` imported by ``kvrelay model import-gguf`` (float32), for the session."""
    from kvrelay.engine.gguf import import_gguf

    return import_gguf(real_gguf_path, tmp_path_factory.mktemp("real") / "smollm2")


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
