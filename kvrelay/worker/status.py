"""A worker's status endpoints: ``/health``, ``/ready``, ``/metrics`` (what probes call).

A small threaded HTTP server beside the worker's loop, so a busy step never delays a probe.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

# how often the server thread checks for ``close`` (the standard library's 0.5 s made every
# worker's exit wait ~0.3 s on it); a select wake-up this often costs nothing measurable
_SHUTDOWN_POLL_S = 0.05


class StatusServer:
    """Serves ``/health`` (process up), ``/ready`` (``is_ready()``), ``/metrics`` and
    ``/stats`` (``stats()`` as JSON) on ``host:port`` (port 0: any free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        is_ready: Callable[[], bool],
        stats: Callable[[], dict[str, Any]],
    ) -> None:
        handler = _make_handler(registry, is_ready, stats)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _SHUTDOWN_POLL_S},
            name="status-http",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _make_handler(
    registry: CollectorRegistry,
    is_ready: Callable[[], bool],
    stats: Callable[[], dict[str, Any]],
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self._send(200, b'{"status":"ok"}', "application/json")
            elif path == "/ready":
                ready = is_ready()
                body = json.dumps({"ready": ready}).encode()
                self._send(200 if ready else 503, body, "application/json")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/stats":
                self._send(200, json.dumps(stats()).encode(), "application/json")
            else:
                self._send(404, b'{"error":"not found"}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("status %s", format % args)

    return Handler
