"""The router process: OpenAI HTTP API over the cluster backend, plus operations routes.

SIGTERM (or Ctrl-C) shuts down gracefully: ``/ready`` fails and new requests get 503 at
once, the streams in flight finish, then the server exits; after ``drain_timeout`` it exits
regardless, and a second signal exits at once.

Never imports torch: the tokenizer, sampling parameters and messages are torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import json
import logging
import math
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
import zmq
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvrelay.autoscale.autoscaler import Autoscaler, AutoscalerSettings, UpdateError
from kvrelay.autoscale.policy import Policy, PolicyConfig
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.pooling import ClassifierConfig
from kvrelay.router import EXIT_ADDRESS_IN_USE
from kvrelay.router.api import create_app
from kvrelay.router.api_settings import ApiSettings
from kvrelay.router.cache_stats import build_report, fetch_worker_stats
from kvrelay.router.dispatcher import Dispatcher, DispatcherSettings
from kvrelay.router.errors import ApiError, require_admin_token
from kvrelay.router.http_guards import with_header_timeout
from kvrelay.router.registry import DEFAULT_PREFILL_QUEUE_LIMIT
from kvrelay.router.request_body import parse_json_object
from kvrelay.router.text_workers import TextWorkers
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.transport.curve import SocketSecurity, describe

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
    drain_timeout: float = 30.0  # on SIGTERM: seconds for the streams in flight to finish
    max_inflight: int = 1024  # requests on the workers at once; more wait or get 429
    max_queue_time: float = 0.0  # seconds a request may wait for a slot before 503
    cache_weight: float = 1.0  # DispatcherSettings.cache_weight (placement)
    prefill_queue_limit: float = DEFAULT_PREFILL_QUEUE_LIMIT  # DispatcherSettings (placement)
    max_body_bytes: int = 4 << 20  # larger bodies get 413
    api_keys: tuple[str, ...] = ()  # bearer keys required on all but the probes; () = open
    ssl_certfile: str | None = None  # TLS certificate of the HTTP API (PEM); None = plain HTTP
    ssl_keyfile: str | None = None  # its private key (PEM)
    header_timeout: float = 10.0  # seconds to receive a request's headers before 408
    body_timeout: float = 30.0  # seconds to receive a request's body before 408
    cluster_id: str = "default"  # the cluster's id (the local scaling hook's workers get it)
    autoscale: str = "off"  # scaling hook: off | local | compose | kubernetes | webhook | exec
    autoscale_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # hook kwargs
    autoscale_policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    autoscale_interval: float = 2.0  # seconds between autoscaler evaluations
    credential: ClusterCredential | None = None  # None: open control socket (opt-out only)

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0, got {self.header_timeout}")
        if not 0 <= self.cache_weight < math.inf:
            raise ValueError(f"--cache-weight must be >= 0 and finite, got {self.cache_weight}")
        if not self.prefill_queue_limit >= 0:
            raise ValueError(
                f"--prefill-queue-limit must be >= 0 (inf: never), got {self.prefill_queue_limit}"
            )

    tool_call_parser: str | None = "auto"  # ApiSettings.tool_call_parser
    trust_request_chat_template: bool = False  # apply a request's chat_template (else 400)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the admin token)
    allow_runtime_lora_updating: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


def context_window(model_dir: str | Path) -> int:
    """The checkpoint's context window (``max_position_embeddings`` of its config.json).

    The router reads only this from the model config; the workers validate the rest, and
    each reports its own ``max_model_len`` when it registers.
    """
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        return int(cfg.get("max_position_embeddings", 4096))
    except FileNotFoundError:
        raise ValueError(f"{model_dir}: no config.json (not a checkpoint directory)") from None
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: cannot read max_position_embeddings: {e}") from None


def build_app(config: RouterConfig) -> tuple[FastAPI, Dispatcher]:
    tokenizer = Tokenizer.from_pretrained(config.model)
    window = context_window(config.model)
    max_len = min(config.max_model_len or window, window)
    backend = Dispatcher(
        tokenizer,
        config.model_name,
        max_len,
        DispatcherSettings(
            config.control_addr,
            config.dead_after,
            config.max_inflight,
            max_queue_time=config.max_queue_time,
            cache_weight=config.cache_weight,
            prefill_queue_limit=config.prefill_queue_limit,
        ),
        SocketSecurity(config.credential),
    )
    settings = ApiSettings(
        served_model_names=(config.model_name,),
        max_body_bytes=config.max_body_bytes,
        admin_token=config.admin_token,
        api_keys=config.api_keys,
        body_timeout=config.body_timeout,
        tool_call_parser=config.tool_call_parser,
        trust_request_chat_template=config.trust_request_chat_template,
        classifier=ClassifierConfig.from_model_dir(config.model),
    )
    text = TextWorkers(tokenizer, config.model)
    app = create_app(backend, tokenizer, settings, text)
    add_operations_routes(app, backend, settings)
    add_lora_routes(app, backend, settings, config.allow_runtime_lora_updating)
    autoscaler = create_autoscaler(config, backend)
    add_autoscaler_routes(app, autoscaler, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        text.start()
        logger.info(
            "router: workers connect to %s (%s)", config.control_addr, describe(backend.security)
        )
        if autoscaler is not None:
            autoscaler.start()
        try:
            yield
        finally:
            if autoscaler is not None:
                await autoscaler.stop()
            await backend.close()
            text.close()

    app.router.lifespan_context = lifespan
    return app, backend


def add_operations_routes(app: FastAPI, backend: Dispatcher, settings: ApiSettings) -> None:
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
        return build_report(per_instance, unreachable, host_ids, backend.cache_index.sizes())

    @app.post("/admin/instances/{instance_id}/drain", dependencies=admin)
    async def drain(instance_id: str) -> dict[str, Any]:
        if not backend.drain(instance_id):
            raise ApiError(404, f"no instance {instance_id!r}", code="not_found")
        return {"instance_id": instance_id, "draining": True}

    @app.post("/admin/instances/{instance_id}/undrain", dependencies=admin)
    async def undrain(instance_id: str) -> dict[str, Any]:
        if not backend.undrain(instance_id):
            raise ApiError(404, f"no instance {instance_id!r}", code="not_found")
        return {"instance_id": instance_id, "draining": False}

    @app.get("/admin/instances", dependencies=admin)
    async def instances() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [inst.as_dict() for inst in backend.registry.instances()],
            "num_inflight": backend.num_inflight,
        }


def add_lora_routes(
    app: FastAPI, backend: Dispatcher, settings: ApiSettings, allowed: bool
) -> None:
    """vLLM's runtime LoRA endpoints (``router.lora_admin``): behind the admin token, and
    answering 403 unless the router was started with ``--allow-runtime-lora-updating``."""
    admin = [Depends(require_admin_token(settings))]

    async def body(request: Request, *names: str) -> list[str]:
        if not allowed:
            raise ApiError(
                403, "runtime LoRA updating is off: start the router with "
                "--allow-runtime-lora-updating", type="permission_error", code="forbidden",
            )  # fmt: skip
        data = parse_json_object(await request.body())
        values = []
        for name in names:
            value = data.get(name)
            if not isinstance(value, str) or not value:
                raise ApiError(400, f"'{name}' must be a non-empty string", param=name)
            values.append(value)
        return values

    @app.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(request: Request) -> Response:
        name, path = await body(request, "lora_name", "lora_path")
        await backend.lora_admin.load(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(request: Request) -> Response:
        (name,) = await body(request, "lora_name")
        await backend.lora_admin.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def create_autoscaler(config: RouterConfig, backend: Dispatcher) -> Autoscaler | None:
    """The autoscaler ``config.autoscale`` names, or None when it is off.

    The ``local`` hook gets the router's model, control address, cluster id and host unless
    ``autoscale_options`` set them. Raises ``ValueError`` for an unknown hook or bad options.
    """
    if config.autoscale == "off":
        return None
    from kvrelay.autoscale.registry import create_hook

    options = dict(config.autoscale_options)
    if config.autoscale == "local":
        defaults = {
            "model": config.model,
            "control_addr": config.control_addr,
            "cluster_id": config.cluster_id,
            "host": config.host,
            "credential": config.credential,
        }
        options = {**defaults, **options}
    try:
        hook = create_hook(config.autoscale, **options)
    except TypeError as e:  # an option the hook does not take
        raise ValueError(f"bad options for the {config.autoscale} scaling hook: {e}") from None
    settings = AutoscalerSettings(interval_s=config.autoscale_interval)
    return Autoscaler(backend, hook, Policy(config.autoscale_policy), settings)


def add_autoscaler_routes(
    app: FastAPI, autoscaler: Autoscaler | None, settings: ApiSettings
) -> None:
    admin = [Depends(require_admin_token(settings))]

    @app.get("/admin/autoscaler", dependencies=admin)
    async def autoscaler_state() -> dict[str, Any]:
        if autoscaler is None:
            return {"enabled": False, "hook": None, "recent_decisions": [], "errors": []}
        return autoscaler.state()

    @app.post("/admin/autoscaler", dependencies=admin)
    async def autoscaler_update(request: Request) -> dict[str, Any]:
        body = parse_json_object(await request.body())
        if autoscaler is None:
            raise ApiError(
                400,
                "autoscaling is off; start the router with --autoscale HOOK",
                code="autoscaler_off",
            )
        try:
            return autoscaler.update(body)
        except UpdateError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


def run_router(config: RouterConfig) -> None:
    app, backend = build_app(config)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        log_level="warning",
        timeout_graceful_shutdown=5,
        http=with_header_timeout(config.header_timeout),
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
    )
    # both addresses are bound before the server starts: one that is taken exits with
    # EXIT_ADDRESS_IN_USE (uvicorn's own bind would exit 3, as any failed start does)
    try:
        backend.bind()
        listener = listen_socket(config.host, config.port)
    except (OSError, zmq.ZMQError) as e:
        if e.errno != errno.EADDRINUSE:
            raise
        logger.error(
            "router: cannot start: %s (HTTP %s:%d, control %s)",
            e,
            config.host,
            config.port,
            config.control_addr,
        )
        raise SystemExit(EXIT_ADDRESS_IN_USE) from None
    scheme = "https" if config.ssl_certfile else "http"
    logger.info(
        "router: serving %s on %s://%s:%d", config.model_name, scheme, config.host, config.port
    )
    _DrainingServer(uv_config, backend, config.drain_timeout).run(sockets=[listener])


def listen_socket(host: str, port: int) -> socket.socket:
    """The router's HTTP socket, bound as uvicorn binds one (SO_REUSEADDR: connections of a
    router stopped a moment ago, in TIME_WAIT, do not refuse its restart)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT only stops taking requests
    (``Dispatcher.stop_accepting``); the server exits once nothing is in flight or
    ``drain_timeout`` has passed; a second signal exits at once."""

    def __init__(self, config: Any, backend: Dispatcher, drain_timeout: float) -> None:
        super().__init__(config)
        self._backend = backend
        self._drain_timeout = drain_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self._drain_timeout
            self._backend.stop_accepting()
            logger.info(
                "router: signal %d; finishing %d request(s) in flight",
                sig,
                self._backend.num_inflight,
            )
            return
        logger.warning("router: second signal %d; exiting now", sig)
        self.force_exit = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            if self._backend.num_inflight == 0:
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                logger.warning(
                    "router: drain timeout with %d request(s) in flight; exiting",
                    self._backend.num_inflight,
                )
                self.should_exit = True
        return await super().on_tick(counter)
