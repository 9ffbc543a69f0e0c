"""``kvrelay up`` and ``kvrelay serve``: the commands that start cluster processes.

Decides the router, worker and autoscaling options, the precedence of flags over the
``KVRELAY_*`` environment (through ``kvrelay.envs``), and the config each process starts with.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from typing import Any, NoReturn

from kvrelay import envs
from kvrelay.cli.engine_args import add_engine_args, engine_cli_args, engine_kwargs
from kvrelay.cli.secret import add_auth_options, load_credential


def add_cluster_parsers(sub: Any) -> None:
    """``up`` and ``serve``."""
    up = sub.add_parser(
        "up", help="start router + workers as local processes (the embedded default)"
    )
    add_engine_args(up)
    up.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    up.add_argument(
        "--colocated", type=int, default=0, help="colocated workers (no hand-off) instead"
    )
    for role in ("prefill", "decode"):
        up.add_argument(
            f"--{role}-threads",
            type=int,
            default=None,
            help=f"CPU threads of each {role} worker (default: --threads, else the CPUs split "
            "between the workers)",
        )
    up.add_argument("--host", default="127.0.0.1", help="bind address of every process")
    up.add_argument("--port", type=int, default=8000, help="router HTTP port (0: any free)")
    up.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp"])
    up.add_argument("--log-dir", default=None, help="one log file per process (default: stderr)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    up.add_argument(
        "--autoscale", action="store_true", help="the router adds and removes local workers"
    )
    _add_autoscale_args(up)
    _add_up_redis_args(up)
    up.add_argument("--cluster-id", default=None, help="the cluster's id (default: a new one)")
    up.add_argument(
        "--admin-token",
        default=None,
        help="router: bearer token for /admin/* (passed in the environment, not argv) "
        "[env KVRELAY_ADMIN_TOKEN]",
    )
    up.add_argument(
        "--cluster-secret-file",
        default=None,
        help="the cluster secret to use (default: KVRELAY_CLUSTER_SECRET_FILE, "
        "KVRELAY_CLUSTER_SECRET, else a new one per cluster); every process gets it in its "
        "environment",
    )
    _add_chat_args(up)

    serve = sub.add_parser(
        "serve",
        help="run one cluster process (router or worker)",
        epilog="Options marked [env KVRELAY_...] may come from that environment variable "
        "instead. Precedence: flag > environment variable > default. README.md lists every "
        "variable.",
    )
    serve.add_argument(
        "--role", required=True, choices=["router", "prefill", "decode", "colocated"]
    )
    add_engine_args(serve, from_env=True)
    add_auth_options(serve)
    _add_serve_args(serve)
    from kvrelay.autoscale.registry import HOOK_NAMES

    serve.add_argument(
        "--autoscale", default="off", choices=["off", *HOOK_NAMES], help="router: scaling hook"
    )
    serve.add_argument("--autoscale-options", default="{}", help="router: hook options (JSON)")
    _add_autoscale_args(serve)
    _add_chat_args(serve)


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    from kvrelay.text.tool_parsers import TOOL_PARSERS

    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "none", *TOOL_PARSERS],
        help="router: how tool_choice 'auto' finds calls in the output ('auto': detect the "
        "format from the chat template; 'none': answer 400 to tool_choice 'auto')",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="router: apply a request's 'chat_template' (default: answer 400; a request's "
        "template runs on the router and changes what the model is told)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="router: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; "
        "behind the admin token): the workers load a LoRA adapter from a path on their hosts",
    )


def chat_router_args(args: argparse.Namespace) -> list[str]:
    """The router flags of ``_add_chat_args`` as ``kvrelay serve`` words (``kvrelay up``)."""
    out = ["--tool-call-parser", args.tool_call_parser]
    if args.allow_runtime_lora_updating:
        out.append("--allow-runtime-lora-updating")
    return out + (["--trust-request-chat-template"] if args.trust_request_chat_template else [])


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    for name in (
        "KVRELAY_HOST", "KVRELAY_ADVERTISE_HOST", "KVRELAY_PORT", "KVRELAY_CONTROL_ADDR",
        "KVRELAY_STATUS_PORT", "KVRELAY_PEER_PORT", "KVRELAY_CLUSTER_ID", "KVRELAY_INSTANCE_ID",
        "KVRELAY_TRANSPORT", "KVRELAY_HOST_ID", "KVRELAY_SERVED_MODEL_NAME",
        "KVRELAY_ADMIN_TOKEN", "KVRELAY_DRAIN_TIMEOUT", "KVRELAY_API_KEY", "KVRELAY_API_KEY_FILE",
        "KVRELAY_SSL_CERTFILE",
        "KVRELAY_SSL_KEYFILE", "KVRELAY_MAX_INFLIGHT", "KVRELAY_MAX_QUEUE_TIME",
        "KVRELAY_CACHE_WEIGHT", "KVRELAY_PREFILL_QUEUE_LIMIT", "KVRELAY_HEADER_TIMEOUT",
        "KVRELAY_BODY_TIMEOUT",
        "KVRELAY_LAUNCHER_PID", "KVRELAY_CPU_NICE",
    ):  # fmt: skip
        envs.add_option(p, name)
    p.add_argument(
        "--dead-after",
        type=float,
        default=2.0,
        help="router: a worker silent this long is dead (4x this for a worker at --cpu-nice: "
        "its heartbeats yield too); worker: a router silent this long is gone (its requests "
        "are aborted) (s)",
    )
    p.add_argument("--lease-ttl", type=float, default=30.0, help="prefill: KV lease (s)")
    p.add_argument(
        "--host-pool",
        default="auto",
        help="worker: L1 host shared-memory KV pool name ('auto': one per cluster id, host id "
        "and model; 'off': none; a NAME shares one on purpose)",
    )
    p.add_argument(
        "--host-pool-memory", type=float, default=0.25, help="worker: L1 pool size in GiB"
    )
    for name in REDIS_OPTIONS:
        envs.add_option(p, name)
    _add_l2_encrypt(p)
    p.add_argument(
        "--param-peers",
        default="",
        help="worker: hosts serving the weights (`kvrelay pool serve`), nearest first; used "
        "when this host has no parameter pool yet, before falling back to disk",
    )
    p.add_argument(
        "--no-param-pool",
        action="store_true",
        help="worker: load weights from disk instead of the host's parameter pool",
    )
    p.add_argument("--corrupt-transfers", type=int, default=0, help=argparse.SUPPRESS)


REDIS_OPTIONS = (
    "KVRELAY_REDIS_URL",
    "KVRELAY_REDIS_PASSWORD_FILE",
    "KVRELAY_REDIS_CA_FILE",
    "KVRELAY_REDIS_CERT_FILE",
    "KVRELAY_REDIS_KEY_FILE",
)


def _add_l2_encrypt(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--l2-encrypt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="worker: encrypt KV blocks written to Redis (AES-256-GCM under the cluster "
        "secret); default: on when the cluster secret is set. --no-l2-encrypt keeps the MAC "
        "(forged blocks are still rejected) but stores KV readable to whoever reads Redis",
    )


def _add_up_redis_args(p: argparse.ArgumentParser) -> None:
    """``kvrelay up``: the L2 options, passed on to every worker it starts."""
    for name in REDIS_OPTIONS:
        var = envs.BY_NAME[name]
        p.add_argument(var.flag, default="", help=var.help.removeprefix("worker: "))
    _add_l2_encrypt(p)


def redis_worker_args(args: argparse.Namespace) -> list[str]:
    """The L2 flags ``kvrelay up`` was given, as ``kvrelay serve`` flags for its workers."""
    out: list[str] = []
    for name in REDIS_OPTIONS:
        var = envs.BY_NAME[name]
        if getattr(args, var.dest):
            out += [var.flag, getattr(args, var.dest)]
    if args.l2_encrypt is not None:
        out.append("--l2-encrypt" if args.l2_encrypt else "--no-l2-encrypt")
    return out


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    for role in ("prefill", "decode"):
        p.add_argument(f"--min-{role}", type=int, default=None, help=f"autoscale: min {role}")
        p.add_argument(f"--max-{role}", type=int, default=None, help=f"autoscale: max {role}")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="autoscale: prefill SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="autoscale: decode SLO")
    p.add_argument("--autoscale-interval", type=float, default=2.0, help="seconds per decision")
    p.add_argument(
        "--autoscale-policy",
        default="{}",
        help='more policy settings as JSON, e.g. {"decode": {"cooldown_down_s": 30}}',
    )


def _json_object(text: str, flag: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def autoscale_policy(args: argparse.Namespace) -> Any:
    """The router's ``PolicyConfig`` from ``--autoscale-policy`` and the per-role flags."""
    from kvrelay.autoscale.policy import PolicyConfig

    policy = PolicyConfig.from_dict(_json_object(args.autoscale_policy, "--autoscale-policy"))
    policy = policy.with_target(
        "prefill", min_instances=args.min_prefill, max_instances=args.max_prefill,
        slo_ms=args.slo_ttft_ms,
    )  # fmt: skip
    return policy.with_target(
        "decode", min_instances=args.min_decode, max_instances=args.max_decode,
        slo_ms=args.slo_tpot_ms,
    )  # fmt: skip


def autoscale_router_args(args: argparse.Namespace, cluster_id: str) -> list[str]:
    """``kvrelay up --autoscale``: the router flags that let it scale with the local hook."""
    worker_args = [
        *engine_cli_args(args),
        *redis_worker_args(args),
        "--transport", args.transport,
        "--host-pool", f"kvrelay-{cluster_id}-l1",  # the launcher's pool (host_pool_name)
    ]  # fmt: skip
    options = {"worker_args": worker_args, "log_dir": args.log_dir}
    out = [
        "--cluster-id", cluster_id,
        "--autoscale", "local",
        "--autoscale-options", json.dumps(options),
        "--autoscale-interval", str(args.autoscale_interval),
        "--autoscale-policy", args.autoscale_policy,
    ]  # fmt: skip
    limits = (
        "min_prefill",
        "max_prefill",
        "min_decode",
        "max_decode",
        "slo_ttft_ms",
        "slo_tpot_ms",
    )
    for name in limits:
        if getattr(args, name) is not None:
            out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def cmd_up(args: argparse.Namespace) -> int:
    from kvrelay.cli.launcher import ClusterSpec, run_up
    from kvrelay.protocol.credential import ClusterCredential, CredentialError

    default = 0 if args.colocated else 1
    router_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    router_args += chat_router_args(args)
    cluster_id = args.cluster_id or ""
    if args.colocated and (args.prefill_threads or args.decode_threads):
        raise ValueError("--prefill-threads and --decode-threads are for P/D workers; "
                         "--threads sets a colocated worker's")  # fmt: skip
    if args.autoscale:
        if args.colocated:
            raise ValueError("--autoscale scales prefill and decode workers, not --colocated")
        cluster_id = cluster_id or f"up{os.getpid()}-{uuid.uuid4().hex[:6]}"
        router_args += autoscale_router_args(args, cluster_id)
    try:
        credential = ClusterCredential.load(args.cluster_secret_file)
    except CredentialError as e:
        raise ValueError(str(e)) from None
    spec = ClusterSpec(
        model=args.model,
        num_prefill=default if args.prefill is None else args.prefill,
        num_decode=default if args.decode is None else args.decode,
        num_colocated=args.colocated,
        host=args.host,
        port=args.port,
        transport=args.transport,
        cluster_id=cluster_id,
        worker_args=(*engine_cli_args(args), *redis_worker_args(args)),
        router_args=tuple(router_args),
        log_dir=args.log_dir,
        credential=credential or ClusterCredential.generate(),
        admin_token=args.admin_token or envs.get("KVRELAY_ADMIN_TOKEN"),
        role_threads={
            role: threads
            for role, threads in (
                ("prefill", args.prefill_threads),
                ("decode", args.decode_threads),
            )
            if threads is not None
        },
        autoscale=args.autoscale,
    )
    return run_up(spec, args.timeout)


def exit_without_finalizing(code: int) -> NoReturn:
    """Ends a router or worker that has closed everything it owns (sockets, shared memory,
    pools, child processes) without the interpreter's finalization: collecting torch's, FastAPI's
    and pydantic's module graphs took ~1 s of every exit, which a rolling restart, a scale-down
    and each test's cluster waited for. Logs and standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvrelay.cli.launcher import follow_launcher

    if args.role == "router" and args.cpu_nice:
        raise ValueError("--cpu-nice is a worker's (a router does not step the model)")
    if args.role != "router":
        from kvrelay.worker.cpu_priority import lower_cpu_priority

        lower_cpu_priority(args.cpu_nice)  # before any thread starts: they inherit it
        from kvrelay.engine.device import keep_step_memory

        keep_step_memory()  # before the weights: steps reuse freed activations
    if args.launcher_pid:
        follow_launcher(args.launcher_pid)  # a process `kvrelay up` started ends with it
    exposed = (
        f"the control socket {args.control_addr}"
        if args.role == "router"
        else "this worker's peer (KV hand-off) socket"
    )
    credential = load_credential(args, exposed)
    if args.role == "router":
        from kvrelay.router.http_guards import read_api_keys
        from kvrelay.router.server import RouterConfig, run_router

        run_router(
            RouterConfig(
                model=args.model,
                control_addr=args.control_addr,
                host=args.host,
                port=args.port,
                served_model_name=args.served_model_name,
                admin_token=args.admin_token or None,
                max_model_len=args.max_model_len,
                dead_after=args.dead_after,
                drain_timeout=args.drain_timeout,
                max_inflight=args.max_inflight,
                max_queue_time=args.max_queue_time,
                cache_weight=args.cache_weight,
                prefill_queue_limit=args.prefill_queue_limit,
                api_keys=read_api_keys(args.api_key, args.api_key_file),
                ssl_certfile=args.ssl_certfile,
                ssl_keyfile=args.ssl_keyfile,
                header_timeout=args.header_timeout,
                body_timeout=args.body_timeout,
                cluster_id=args.cluster_id,
                autoscale=args.autoscale,
                autoscale_options=_json_object(args.autoscale_options, "--autoscale-options"),
                autoscale_policy=autoscale_policy(args),
                autoscale_interval=args.autoscale_interval,
                credential=credential,
                tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                trust_request_chat_template=args.trust_request_chat_template,
                allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            )
        )
        exit_without_finalizing(0)
    from kvrelay.protocol.messages import Role
    from kvrelay.worker.config import WorkerConfig
    from kvrelay.worker.serve import run_worker

    run_worker(
        WorkerConfig(
            role=Role(args.role),
            model=args.model,
            router_addr=args.control_addr,
            cluster_id=args.cluster_id,
            instance_id=args.instance_id,
            host=args.host,
            advertise_host=args.advertise_host,
            host_id=args.host_id,
            status_port=args.status_port,
            peer_port=args.peer_port,
            transport=args.transport,
            served_model_name=args.served_model_name,
            lease_ttl=args.lease_ttl,
            router_timeout=args.dead_after,
            host_pool="" if args.host_pool == "off" else args.host_pool,
            host_pool_bytes=int(args.host_pool_memory * (1 << 30)),
            redis_url=args.redis_url,
            redis_password_file=args.redis_password_file,
            redis_ca_file=args.redis_ca_file,
            redis_cert_file=args.redis_cert_file,
            redis_key_file=args.redis_key_file,
            l2_encrypt=args.l2_encrypt,
            corrupt_transfers=args.corrupt_transfers,
            param_pool=not args.no_param_pool,
            param_peers=args.param_peers,
            drain_timeout=args.drain_timeout,
            engine_args=engine_kwargs(args),
            credential=credential,
        )
    )
    exit_without_finalizing(0)
