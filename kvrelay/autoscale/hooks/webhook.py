"""The ``webhook`` hook: POSTs each decision as JSON to a URL.

Body: ``decision.as_dict()`` plus ``"source": "kvrelay-autoscaler"``. Any 2xx means applied.
Connection errors and 5xx are retried (``attempts`` in all, backoff doubling from
``backoff`` seconds); a 4xx is the receiver refusing the decision and is not retried. Every
attempt and wait fits in ``timeout`` seconds in total.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from kvrelay.autoscale.base import HookError, ScaleDecision, ScalingHook

logger = logging.getLogger(__name__)

SOURCE = "kvrelay-autoscaler"
BODY_TAIL_CHARS = 500  # how much of a refusing response's body a HookError quotes


class WebhookHook(ScalingHook):
    name = "webhook"

    def __init__(
        self,
        *,
        url: str,
        token: str | None = None,
        timeout: float = 10.0,
        attempts: int = 3,
        backoff: float = 0.5,
    ) -> None:
        """
        Args:
            url: an http(s) URL that receives the POST.
            token: sent as ``Authorization: Bearer <token>`` when set.
            timeout: seconds for the whole ``apply``, retries and waits included.
            attempts: tries before giving up on connection errors and 5xx.
            backoff: seconds before the second try; doubles after each failed try.
        """
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook url must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"webhook timeout must be > 0, got {timeout}")
        if attempts < 1:
            raise ValueError(f"webhook attempts must be >= 1, got {attempts}")
        if backoff < 0:
            raise ValueError(f"webhook backoff must be >= 0, got {backoff}")
        self.url = url
        self.token = token
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff

    def payload(self, decision: ScaleDecision) -> dict[str, Any]:
        """The JSON body ``apply`` sends for ``decision``."""
        return {**decision.as_dict(), "source": SOURCE}

    def apply(self, decision: ScaleDecision) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body = self.payload(decision)
        deadline = time.monotonic() + self.timeout
        failure = "no attempt fit in the timeout"
        tried = 0
        with httpx.Client(headers=headers) as client:
            while tried < self.attempts:
                if tried:
                    time.sleep(min(self.backoff * 2 ** (tried - 1), _left(deadline)))
                left = _left(deadline)
                if left <= 0:
                    break
                tried += 1
                try:
                    response = client.post(self.url, json=body, timeout=left)
                except httpx.TransportError as e:
                    failure = f"{type(e).__name__}: {e}"
                else:
                    if response.is_success:
                        logger.info("webhook hook: %s accepted %s", self.url, response.status_code)
                        return
                    failure = f"HTTP {response.status_code}: {response.text[-BODY_TAIL_CHARS:]}"
                    if response.status_code < 500:
                        raise HookError(f"webhook {self.url} refused the decision: {failure}")
                logger.warning("webhook hook: attempt %d: %s", tried, failure)
        raise HookError(f"webhook {self.url} failed after {tried} attempt(s): {failure}")


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
