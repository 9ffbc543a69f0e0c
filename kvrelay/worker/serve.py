"""``kvrelay serve --role prefill|decode|colocated``: one worker process."""

from __future__ import annotations

from kvrelay.protocol.messages import Role
from kvrelay.worker.config import WorkerConfig
from kvrelay.worker.runtime import Worker


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
