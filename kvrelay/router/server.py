"""The router process: OpenAI HTTP API over the cluster backend, plus operations routes.

Never imports torch: the tokenizer, sampling parameters and messages are torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.engine.config import ModelConfig
from kvrelay.engine.tokenizer import Tokenizer
from kvrelay.router.api import ApiSettings, create_app
from kvrelay.router.cache_stats import build_report, fetch_worker_stats
from kvrelay.router.cluster import ClusterBackend, ClusterSettings
from kvrelay.router.errors import ApiError, require_admin_token

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str  # checkpoint directory (tokenizer, chat template, context window)
    control_addr: str  # ZMQ address workers connect to, e.g. tcp://127.0.0.1:5557
    host: str = "127.0.0.1"  # HTTP bind address
    port: int = 8000  # HTTP port
    served_model_name: str = ""  # name clients use; default: the directory name
    admin_token: str | None = None  # bearer token for /admin/*; None = open
    max_model_len: int | None = None  # cap on the context window
    dead_after: float = 2.0  # seconds without a heartbeat before a worker is dead
    max_inflight: int = 1024  # requests in flight before 429
    max_body_bytes: int = 4 << 20  # larger bodies get 413

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


def build_app(config: RouterConfig) -> tuple[FastAPI, ClusterBackend]:
    tokenizer = Tokenizer.from_pretrained(config.model)
    model_config = ModelConfig.from_dir(config.model)
    max_len = min(
        config.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )
    backend = ClusterBackend(
        tokenizer,
        config.model_name,
        max_len,
        ClusterSettings(config.control_addr, config.dead_after, config.max_inflight),
    )
    settings = ApiSettings(
        served_model_names=(config.model_name,),
        max_body_bytes=config.max_body_bytes,
        admin_token=config.admin_token,
    )
    app = create_app(backend, tokenizer, settings)
    add_operations_routes(app, backend, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        logger.info("router: workers connect to %s", config.control_addr)
        try:
            yield
        finally:
            await backend.close()

    app.router.lifespan_context = lifespan
    return app, backend


def add_operations_routes(app: FastAPI, backend: ClusterBackend, settings: ApiSettings) -> None:
    admin = [Depends(require_admin_token(settings))]

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(backend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/cache/stats", dependencies=admin)
    async def cache_stats() -> dict[str, Any]:
        instances = backend.registry.instances()
        urls = {i.instance_id: i.info.status_url for i in instances}
        per_instance, unreachable = await fetch_worker_stats(urls)
        host_ids = {i.instance_id: i.info.host_id for i in instances}
        return build_report(per_instance, unreachable, host_ids)

    @app.post("/admin/instances/{instance_id}/drain", dependencies=admin)
    async def drain(instance_id: str) -> dict[str, Any]:
        if not backend.drain(instance_id):
            raise ApiError(404, f"no instance {instance_id!r}", code="not_found")
        return {"instance_id": instance_id, "draining": True}

    @app.get("/admin/instances", dependencies=admin)
    async def instances() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [inst.as_dict() for inst in backend.registry.instances()],
            "num_inflight": backend.num_inflight,
        }


def run_router(config: RouterConfig) -> None:
    import uvicorn

    app, _ = build_app(config)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    logger.info("router: serving %s on http://%s:%d", config.model_name, config.host, config.port)
    uvicorn.Server(uv_config).run()
