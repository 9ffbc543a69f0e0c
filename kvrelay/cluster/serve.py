"""``kvrelay serve --role prefill|decode|colocated``: one worker process."""

from __future__ import annotations

from kvrelay.cluster.messages import Role
from kvrelay.cluster.worker import Worker
from kvrelay.cluster.worker_config import WorkerConfig


def create_worker(config: WorkerConfig) -> Worker:
    """The worker class for ``config.role`` (imported only when chosen)."""
    if config.role is Role.PREFILL:
        from kvrelay.prefill.worker import PrefillWorker

        return PrefillWorker(config)
    if config.role is Role.DECODE:
        from kvrelay.decode.worker import DecodeWorker

        return DecodeWorker(config)
    return Worker(config)


def run_worker(config: WorkerConfig) -> None:
    create_worker(config).run()
