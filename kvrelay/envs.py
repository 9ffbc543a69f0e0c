"""Every environment variable kvrelay reads, in one typed table.

Each ``KVRELAY_*`` variable has a type, a default and a line of help. Most stand in for a
``kvrelay serve`` option (``flag``), so a container can be configured with environment
variables instead of a shell wrapper that expands them into the command. Precedence is
**flag > environment variable > default**: a flag given on the command line always wins.

Values are parsed when they are read, never at import time, and a bad value is an error
naming the variable and the value (``EnvError``), not a silent fallback to the default.
An empty value counts as unset.

    from kvrelay import envs
    token = envs.get("KVRELAY_ADMIN_TOKEN")        # None when unset

``python -m kvrelay.envs`` prints the table as Markdown (README.md holds that output; a test
checks they agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
TRANSPORTS = ("auto", "shm", "tcp", "cuda_ipc")


class EnvError(ValueError):
    """An environment variable holds a value of the wrong type or outside its choices."""


@dataclasses.dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its type, its default, and the option it stands in for."""

    name: str
    type: type  # str | int | float | bool (a bool's flag takes no value)
    default: Any  # used when neither the flag nor the variable is set; None: unset
    help: str  # one line, shown in README and in ``--help``
    flag: str = ""  # the command-line option it supplies, "" for none
    commands: tuple[str, ...] = ("serve",)  # the commands whose option it supplies
    choices: tuple[str, ...] = ()  # the valid values, when there is a fixed set
    required: bool = False  # the command needs a value from the flag or the variable
    per_process: bool = False  # names one process: never passed on to processes it starts

    @property
    def dest(self) -> str:
        """The argparse attribute of ``flag``."""
        return self.flag.removeprefix("--").replace("-", "_")

    def parse(self, text: str) -> Any:
        """``text`` as this variable's type; raises EnvError naming the variable."""
        if self.type is bool:
            return _parse_bool(self.name, text)
        try:
            value = self.type(text)
        except ValueError:
            raise EnvError(f"{self.name}={text!r}: expected {_TYPE_NAMES[self.type]}") from None
        if self.choices and value not in self.choices:
            raise EnvError(f"{self.name}={text!r}: expected one of {', '.join(self.choices)}")
        if self.type in (int, float) and value < 0:
            raise EnvError(f"{self.name}={text!r}: expected a value >= 0")
        return value


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number"}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _parse_bool(name: str, text: str) -> bool:
    try:
        return _BOOLS[text.strip().lower()]
    except KeyError:
        raise EnvError(f"{name}={text!r}: expected 1/true/yes or 0/false/no") from None


def _var(name: str, type_: type, default: Any, help_: str, flag: str = "", **kw: Any) -> EnvVar:
    return EnvVar(name, type_, default, help_, flag, **kw)


ENV_VARS: tuple[EnvVar, ...] = (
    _var("KVRELAY_MODEL", str, None, "checkpoint directory (Hugging Face format)", "--model",
         required=True),
    _var("KVRELAY_CONTROL_ADDR", str, None,
         "ZMQ address of the router's control socket: the router binds it, workers connect "
         "(comma-separated for several routers)", "--control-addr", required=True),
    _var("KVRELAY_HOST", str, "127.0.0.1", "address to bind", "--host"),
    _var("KVRELAY_ADVERTISE_HOST", str, "",
         "worker: address peers and the router use (default: --host, or the host name when "
         "binding a wildcard)", "--advertise-host", per_process=True),
    _var("KVRELAY_PORT", int, 8000, "router: HTTP port", "--port", per_process=True),
    _var("KVRELAY_STATUS_PORT", int, 0, "worker: port of /health /ready /metrics (0: any free)",
         "--status-port", per_process=True),
    _var("KVRELAY_PEER_PORT", int, 0, "worker: KV hand-off port (0: any free)", "--peer-port",
         per_process=True),
    _var("KVRELAY_CLUSTER_ID", str, "default", "namespaces the shared-memory segment names",
         "--cluster-id"),
    _var("KVRELAY_INSTANCE_ID", str, "",
         "worker: unique name (default: ROLE-HOSTNAME-PID)", "--instance-id",
         per_process=True),
    _var("KVRELAY_HOST_ID", str, "",
         "worker: equal ids share memory (default: this machine's id)", "--host-id"),
    _var("KVRELAY_TRANSPORT", str, "auto",
         "KV transport between prefill and decode (auto: cuda_ipc between GPU pools on one "
         "host, shm between CPU pools on one host, else tcp)",
         "--transport", choices=TRANSPORTS),
    _var("KVRELAY_DEVICE", str, "cpu",
         "where the engine computes and keeps weights and KV: cpu, cuda or cuda:N",
         "--device"),
    _var("KVRELAY_KV_CACHE_GIB", float, 1.0, "GiB for the KV pool when --num-blocks is unset",
         "--kv-cache-memory"),
    _var("KVRELAY_REDIS_URL", str, "",
         "worker: L2 global KV tier, e.g. redis://host:6379/0 or rediss://user@host:6380/0 "
         "(TLS; empty: off)", "--redis-url"),
    _var("KVRELAY_REDIS_PASSWORD_FILE", str, "",
         "worker: file whose first line is the L2 Redis password (wins over one in the URL)",
         "--redis-password-file"),
    _var("KVRELAY_REDIS_CA_FILE", str, "",
         "worker: PEM CA bundle that signed the L2 Redis server's certificate (rediss://)",
         "--redis-ca-file"),
    _var("KVRELAY_REDIS_CERT_FILE", str, "",
         "worker: PEM client certificate for L2 Redis over TLS (with --redis-key-file)",
         "--redis-cert-file"),
    _var("KVRELAY_REDIS_KEY_FILE", str, "",
         "worker: PEM key of --redis-cert-file", "--redis-key-file"),
    _var("KVRELAY_SERVED_MODEL_NAME", str, "",
         "the model name clients use (default: the checkpoint directory's name)",
         "--served-model-name"),
    _var("KVRELAY_ADMIN_TOKEN", str, None,
         "router: bearer token for /admin/* (unset: open); also sent by `kvrelay up`",
         "--admin-token"),
    _var("KVRELAY_DRAIN_TIMEOUT", float, 30.0,
         "seconds a SIGTERM leaves to finish what runs (router: its streams; worker: its "
         "requests) before exiting; a second SIGTERM exits at once", "--drain-timeout"),
    _var("KVRELAY_CACHE_DIR", str, "~/.cache/kvrelay",
         "where `kvrelay model get` keeps the models it downloads", "--cache-dir",
         commands=("model",)),
    _var("KVRELAY_API_KEY", str, None,
         "router: API keys required as `Authorization: Bearer` on every route but the probes "
         "(comma-separated; unset: open)", "--api-key"),
    _var("KVRELAY_API_KEY_FILE", str, None,
         "router: file of API keys, one a line (added to --api-key)", "--api-key-file"),
    _var("KVRELAY_SSL_CERTFILE", str, None, "router: TLS certificate (PEM) of the HTTP API",
         "--ssl-certfile"),
    _var("KVRELAY_SSL_KEYFILE", str, None, "router: TLS private key (PEM) of the HTTP API",
         "--ssl-keyfile"),
    _var("KVRELAY_MAX_INFLIGHT", int, 1024,
         "router: requests on the workers at once; more wait (--max-queue-time) or get 429",
         "--max-inflight"),
    _var("KVRELAY_MAX_QUEUE_TIME", float, 0.0,
         "router: seconds a request may wait for a slot before 503 (0: 429 at once)",
         "--max-queue-time"),
    _var("KVRELAY_CACHE_WEIGHT", float, 1.0,
         "router: placement's worth of one cached prompt token in queued prefill tokens (1: "
         "compare in prefill time; above 1 favours cache holders; 0: ignore the cache)",
         "--cache-weight"),
    _var("KVRELAY_PREFILL_QUEUE_LIMIT", float, math.inf,
         "router: prompt tokens queued on a prefill instance from which its decode instance "
         "computes a prompt itself when it would start it sooner (inf: always hand off; "
         "DESIGN.md \"Conditional disaggregation\")",
         "--prefill-queue-limit"),
    _var("KVRELAY_HEADER_TIMEOUT", float, 10.0,
         "router: seconds to receive a request's headers before 408", "--header-timeout"),
    _var("KVRELAY_BODY_TIMEOUT", float, 30.0,
         "router: seconds to receive a request's body before 408", "--body-timeout"),
    _var("KVRELAY_CLUSTER_SECRET_FILE", str, "",
         "file holding the cluster secret (64 hex digits; `kvrelay secret --out FILE` makes "
         "one): authenticates and encrypts the control, peer and chain sockets; else "
         "KVRELAY_CLUSTER_SECRET",
         "--cluster-secret-file", commands=("serve",)),
    _var("KVRELAY_CLUSTER_SECRET", str, "",
         "the cluster secret itself (64 hex digits), when no file is given; never a flag "
         "(argv is readable by every local user)", commands=("serve",)),
    _var("KVRELAY_INSECURE_NO_AUTH", bool, False,
         "run with NO authentication on the control, peer and chain sockets (a trusted, "
         "isolated network only; logged as a warning)", "--insecure-no-auth",
         commands=("serve",)),
    _var("KVRELAY_LOG_LEVEL", str, "info", "log level of every command (-v: debug)",
         "--log-level", commands=(), choices=LOG_LEVELS),
    _var("KVRELAY_CACHE_DIR", str, "~/.cache/kvrelay",
         "what kvrelay keeps between runs: digests of model files (identity/)", "--cache-dir",
         commands=()),
    _var("KVRELAY_CPU_NICE", int, 0,
         "worker: lower this process's CPU priority by this nice value (0-19; and its "
         "autogroup's when it leads its session), so that other workers on its cores go first "
         "(`kvrelay up` and the local autoscaling hook give decode workers 19 where they "
         "share cores with prefill workers); its autogroup is back at 0 while it computes a "
         "prompt of its own; its routers wait 4x `--dead-after` for its heartbeats (they "
         "yield too)",
         "--cpu-nice", per_process=True),
    _var("KVRELAY_LAUNCHER_PID", int, None,
         "exit (as on SIGTERM: a drain) once the process with this pid, the launcher that "
         "started this one, is gone, even killed with SIGKILL (`kvrelay up` sets it)",
         "--launcher-pid", per_process=True),
    _var("KVRELAY_NATIVE_MATMUL", bool, True,
         "CPU decode steps multiply by the weights, and CPU steps run a layer's norms, rotary "
         "and SiLU, in kvrelay's native library (0: torch's; for comparisons)",
         commands=("serve",)),
    _var("KVRELAY_HUGE_PAGES", bool, True,
         "a CPU engine asks Linux for 2 MiB pages (madvise) under its KV pool, whose blocks "
         "a decode step reads scattered: a lone SmolLM2 step at a 2,000-token context 6-8% "
         "faster on an AVX2 VM (a pool shared with peers only where the host's "
         "shmem_enabled allows; 0: 4 KiB pages; for comparisons)",
         commands=("serve",)),
    _var("KVRELAY_CPU_MALLOC_REUSE", bool, True,
         "a CPU engine has glibc's malloc keep the memory a step frees (blocks up to 32 MiB "
         "from its heap, up to 1 GiB of it kept) instead of mapping fresh, zeroed pages for "
         "the next step's activations (0: glibc's defaults; for comparisons)",
         commands=("serve",)),
    _var("KVRELAY_CPU_PACKED_WEIGHTS", bool, None,
         "a float32 or bfloat16 CPU engine keeps a copy of every projection and the LM head in "
         "oneDNN's blocked layout for steps of more than 8 rows (4 in bfloat16 where oneDNN "
         "computes it; batched decode, prefill): "
         "1.8-2.8x faster steps there, at a second copy of the weights' memory, private to the "
         "process (float32 for a bfloat16 model where oneDNN has no bfloat16, an AVX2 CPU: "
         "twice its bytes, and 38-102x faster than torch's bfloat16 products there). Unset: "
         "when that copy fits in a quarter of the memory available, on a "
         "thread while the engine already serves on the plain weights; 1: always, before the "
         "engine starts; 0: never", commands=("serve",)),
    _var("KVRELAY_CPU_PACKED_KERNEL", str, "auto",
         "the packed copy's layout and kernel: panels (kvrelay's native panels of 16 columns, "
         "1.3-1.6x oneDNN's speed at 8-64 rows on an AVX2 CPU, where oneDNN's kernels wait on "
         "memory; on AVX-512, a tile over two panels), onednn (oneDNN's blocked layout), or "
         "auto: panels on a CPU with AVX2 where bfloat16 computes no faster than float32 (no "
         "AMX; AVX512-BF16 dot products, timed once, under 1.25x float32's flops), else onednn",
         commands=("serve",), choices=("auto", "panels", "onednn")),
    _var("KVRELAY_GRAMMAR_WARM_UP", bool, True,
         "a worker builds the grammar compiler's tokenizer tables (xgrammar, which imports "
         "transformers: ~2.5 s of CPU) on a thread as it starts serving, so that the first "
         "structured request does not wait for them (0: on the first structured request, "
         "which then waits ~2.5 s; a worker that never gets one never spends it: the test "
         "suite's setting)", commands=("serve",)),
    _var("KVRELAY_NATIVE_ATTENTION", bool, True,
         "decode tokens attend over the KV pool in kvrelay's own kernel, the native library's "
         "on CPU (with the tokens of prefill segments up to 512 tokens, 8,192 in bfloat16 on "
         "AVX512-BF16 and 2,048 on AVX2-only CPUs) and Triton's on CUDA (0: torch's gather + "
         "SDPA; for comparisons)",
         commands=("serve",)),
    _var("KVRELAY_TRITON_PREFILL", bool, True,
         "on CUDA, a step's prefill segments attend in one Triton launch per layer, reading "
         "the KV pool in place (0: torch's gather + SDPA per segment; for comparisons)",
         commands=("serve",)),
    _var("KVRELAY_TRITON_ROWS", bool, True,
         "on CUDA, a layer's small ops (residual add + RMSNorm, rotary embedding, SiLU x up) "
         "run as one Triton launch each (0: torch's ops, ~20 launches a layer; for comparisons)",
         commands=("serve",)),
    _var("KVRELAY_CUDA_GRAPHS", bool, True,
         "a CUDA engine replays decode-only steps as CUDA graphs, one per padded batch size, "
         "captured by the warm-up (0: every step eager; for comparisons and debugging)",
         commands=("serve",)),
    _var("KVRELAY_MIXED_GRAPHS", bool, True,
         "with KVRELAY_CUDA_GRAPHS, a CUDA engine's prompt and mixed steps replay CUDA graphs "
         "per padded token count: the whole step, or with KVRELAY_TRITON_PREFILL=0 the layers "
         "around attention (0: those steps eager; for comparisons)",
         commands=("serve",)),
)  # fmt: skip
BY_NAME: dict[str, EnvVar] = {v.name: v for v in ENV_VARS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name``, or its default when unset or empty."""
    var = BY_NAME[name]  # a KeyError here is our bug: every variable is in the table
    text = (os.environ if environ is None else environ).get(name, "")
    return var.parse(text) if text else var.default


def inheritable(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables that name one process (its ports, instance id,
    address): what a launcher passes to the workers it starts, so that two of them never
    take the same port or name from their parent's environment."""
    own = {v.name for v in ENV_VARS if v.per_process}
    return {k: v for k, v in environ.items() if k not in own}


def add_option(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Adds ``name``'s flag to ``parser``; ``apply`` fills it in when it is not given."""
    var = BY_NAME[name]
    default = "unset" if var.default in (None, "") else var.default
    if var.type is bool:
        parser.add_argument(
            var.flag,
            action="store_const",
            const=True,
            default=None,
            help=f"{var.help} [env {var.name}=1]".replace("%", "%%"),
            **kwargs,
        )
        return
    parser.add_argument(
        var.flag,
        default=None,
        type=var.type,
        choices=var.choices or None,
        help=f"{var.help} [env {var.name}; default {default}]".replace("%", "%%"),
        **kwargs,
    )


def apply(args: argparse.Namespace, command: str, environ: Mapping[str, str] | None = None) -> None:
    """Fills every option of ``command`` that was not given on the command line from the
    environment, else from the table's default. Raises EnvError for a bad value or a
    required option set nowhere."""
    for var in ENV_VARS:
        if var.commands and command not in var.commands:
            continue
        if not var.flag or not hasattr(args, var.dest) or getattr(args, var.dest) is not None:
            continue
        value = get(var.name, environ)
        if value is None and var.required:
            raise EnvError(f"{var.flag} is required (or set {var.name})")
        setattr(args, var.dest, value)


OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# spins of libgomp's busy wait after a parallel op before its thread sleeps: ~0.3 ms on the
# 2-vCPU EPYC VM (the default, 300,000, spun ~10 ms there)
OPENMP_SHORT_SPIN = 10_000


def use_passive_openmp_wait(environ: MutableMapping[str, str] | None = None) -> bool:
    """Asks torch's OpenMP threads to sleep, not spin, between parallel ops; True if it set
    ``OMP_WAIT_POLICY=PASSIVE``. Call before torch is imported (OpenMP reads it once).

    By default libgomp's threads spin for a while after each op, holding cores that a worker's
    other threads need: the KV copy-and-verify threads, ZMQ's I/O thread, the heartbeat. On the
    2-core machines that took a shm pull from 82-93% of a memcpy to 59-79% right after a torch
    op, and passive waiting cost the engine no measurable throughput (BENCHMARKS.md). A
    deployment that sets any of ``OPENMP_WAIT_VARS`` itself keeps its choice.
    """
    global passive_wait_set_here
    environ = os.environ if environ is None else environ
    if any(name in environ for name in OPENMP_WAIT_VARS):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if environ is os.environ:
        passive_wait_set_here = True
    return True


# True once this process set the passive wait in its own environment (not the deployment):
# a launcher may then choose the short spin for workers that have their cores to themselves
passive_wait_set_here = False


def short_spin_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for a worker that has its cores to itself: the passive wait this process
    set swapped for the short spin (``use_short_openmp_spin``); a deployment's own choice of
    ``OPENMP_WAIT_VARS`` is kept as it is."""
    out = dict(environ)
    if passive_wait_set_here and out.get("OMP_WAIT_POLICY") == "PASSIVE":
        del out["OMP_WAIT_POLICY"]
        use_short_openmp_spin(out)
    return out


def use_short_openmp_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Asks torch's OpenMP threads to spin briefly after each parallel op before sleeping
    (``GOMP_SPINCOUNT=OPENMP_SHORT_SPIN``, ~0.3 ms); True if it set it. Call before torch is
    imported. For a process whose engine owns its cores (the offline ``LLM``).

    A batched CPU step is ~300 parallel ops tens of microseconds apart (torch's and the native
    library's, on one OpenMP team): a passive team sleeps between them and every op then
    waits for its threads to wake. bfloat16 SmolLM2 decode steps of 16 / 32 / 64 sequences
    took 35.8 / 53.5 / 83.7 ms passive against 28.6 / 46.2 / 76.0 with this spin (30,000 and
    300,000 spins: the same), while the thread still frees its core ~0.3 ms after the step's
    last op. Not for workers that share cores with another busy process (a 1P+1D cluster's
    prefill and decode on the same CPUs): there a spinning thread holds the core the other
    needs, and TPOT p50 went 52 -> 80 ms (BENCHMARKS.md "OpenMP wait"). A deployment that sets
    any of ``OPENMP_WAIT_VARS`` itself keeps its choice.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in OPENMP_WAIT_VARS):
        return False
    environ["GOMP_SPINCOUNT"] = str(OPENMP_SHORT_SPIN)
    return True


def markdown_table() -> str:
    """The table as Markdown, for README.md."""
    rows = ["| variable | type | default | option | meaning |", "|---|---|---|---|---|"]
    for var in ENV_VARS:
        default = "unset" if var.default in (None, "") else f"`{var.default}`"
        flag = f"`{var.flag}`" if var.flag else ""
        if var.commands:
            where = f"`kvrelay {'/'.join(var.commands)}`"
            flag = f"{flag} of {where}" if var.flag else f"read by {where}"
        kind = "\\|".join(var.choices) if var.choices else var.type.__name__
        rows.append(f"| `{var.name}` | {kind} | {default} | {flag} | {var.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
