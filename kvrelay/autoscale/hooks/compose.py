"""The ``compose`` hook: ``docker compose up -d --scale`` on one Docker host.

Runs ``<command> -p PROJECT -f FILE up -d --scale <prefill>=N --scale <decode>=M
--no-recreate``: compose starts or removes containers of the two worker services to reach
the counts and leaves every running container (the router included) as it is. Compose
picks which replicas go on a scale-down, so ``decision.drain`` is not used here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvrelay.autoscale.base import ScaleDecision, ScalingHook
from kvrelay.autoscale.hooks.exec import run_command

logger = logging.getLogger(__name__)


class ComposeHook(ScalingHook):
    name = "compose"

    def __init__(
        self,
        *,
        file: str,
        project: str,
        prefill_service: str = "prefill",
        decode_service: str = "decode",
        command: Sequence[str] = ("docker", "compose"),
        timeout: float = 300.0,
    ) -> None:
        """
        Args:
            file: the compose file (``-f``).
            project: the compose project name (``-p``); must be the running cluster's, or
                compose starts a second cluster.
            prefill_service, decode_service: the services that run each worker role.
            command: the compose command (e.g. ``["docker-compose"]``).
            timeout: seconds ``up`` may take (pulling images and starting containers).
        """
        for option, value in (
            ("file", file),
            ("project", project),
            ("prefill_service", prefill_service),
            ("decode_service", decode_service),
        ):
            if not value:
                raise ValueError(f"compose hook needs a non-empty {option!r}")
        if not command:
            raise ValueError("compose hook needs a non-empty 'command'")
        if timeout <= 0:
            raise ValueError(f"compose hook timeout must be > 0, got {timeout}")
        self.file = file
        self.project = project
        self.prefill_service = prefill_service
        self.decode_service = decode_service
        self.command = tuple(command)
        self.timeout = timeout

    def argv(self, decision: ScaleDecision) -> list[str]:
        """The command ``apply`` runs for ``decision``."""
        return [
            *self.command,
            "-p", self.project,
            "-f", self.file,
            "up", "-d",
            "--scale", f"{self.prefill_service}={decision.prefill}",
            "--scale", f"{self.decode_service}={decision.decode}",
            "--no-recreate",
        ]  # fmt: skip

    def apply(self, decision: ScaleDecision) -> None:
        run_command(self.argv(decision), timeout=self.timeout)
        logger.info(
            "compose hook: project %s at %s=%d %s=%d",
            self.project,
            self.prefill_service,
            decision.prefill,
            self.decode_service,
            decision.decode,
        )
