"""The deployment files, checked by the tools that read them and by the processes they name.

- ``compose.yaml`` validates against the Compose Specification (check-jsonschema's vendored
  schema) and loads in ``docker-compose config``; each check skips, naming how to install its
  tool, where the tool is missing. Neither needs a Docker engine or the network.
- Every kvrelay command in it parses with kvrelay's own argument parser, with the
  container's environment. The words are the ones the container would run: compose's
  ``${VAR:-default}`` interpolation, then the command run for real (``sh -c`` included) with
  a stand-in ``kvrelay`` on PATH that prints its argv. Every ``KVRELAY_*`` variable a
  container gets is one of kvrelay's own (``kvrelay.envs``), and no serving container needs
  a shell to build its command.
- The default services run as local processes the way ``docker compose up`` starts them:
  in ``depends_on`` order, each condition waited for by running the service's own
  healthcheck; then one completion goes through the router, the KV hand-off uses shared
  memory, and nothing is left in /dev/shm after they stop.
- The Dockerfile has the build arguments, install steps and entrypoint compose relies on.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvrelay import envs
from kvrelay.cli import parse_args
from kvrelay.cli.launcher import free_port
from kvrelay.protocol.messages import Role
from kvrelay.transport.shm_pool import cleanup_segments
from kvrelay.worker.config import WorkerConfig, resolve_identity
from tests.cluster_harness import metric_value
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DEFAULT_SERVICES = {"redis-secret", "redis", "secret", "model-init", "router", "prefill", "decode"}
ONE_SHOTS = ("secret", "model-init")  # restart "no": they write a volume, then exit
# The image's default entrypoint (the Dockerfile's ENTRYPOINT, checked below).
IMAGE_ENTRYPOINT = ["kvrelay"]
_VAR = re.compile(r"\$(?:\{(?P<braced>\w+)(?::?-(?P<default>[^}]*))?\}|(?P<plain>\w+))")
# A stand-in for the kvrelay command: prints the argv it was given as JSON.
_ECHO_ARGV = "import json, sys\njson.dump(sys.argv[1:], sys.stdout)\n"


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def kvrelay_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if str(svc.get("image", "")).startswith("kvrelay:")
    }


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation over strings, lists and mappings (``$$`` is ``$``)."""
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    parts = value.split("$$")

    def sub(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        return env.get(name) or m.group("default") or ""

    return "$".join(_VAR.sub(sub, part) for part in parts)


def service_argv(svc: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """What the container runs: entrypoint (the image's unless set) + command, interpolated."""
    svc = interpolate(dict(svc), env)
    entrypoint = svc.get("entrypoint", IMAGE_ENTRYPOINT)
    command = svc.get("command", [])
    if isinstance(entrypoint, str):
        entrypoint = shlex.split(entrypoint)
    if isinstance(command, str):
        command = shlex.split(command)
    return [*entrypoint, *command]


def mount_paths(argv: list[str], svc: Mapping[str, Any], root: Path) -> list[str]:
    """Rewrites each volume's container path (e.g. /models) to a directory under ``root``."""
    out = argv
    for volume in interpolate(svc.get("volumes", []), {}):
        target = volume.split(":")[1]
        local = str(root / target.strip("/"))
        pattern = re.compile(rf"(?<![\w/.]){re.escape(target)}(?=/|\b|$)")
        out = [pattern.sub(local, word) for word in out]
    return out


@pytest.fixture
def fake_kvrelay(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    script = bin_dir / "kvrelay"
    script.write_text(f"#!{sys.executable}\n{_ECHO_ARGV}")
    script.chmod(0o755)
    return bin_dir


def kvrelay_words(argv: list[str], bin_dir: Path, hostname: str) -> list[str] | None:
    """The argv the container's command gives ``kvrelay`` (None: it does not run kvrelay).

    Runs ``argv`` for real with the stand-in from ``fake_kvrelay`` first on PATH and
    HOSTNAME set as in a container, so shell quoting, ``$HOSTNAME`` and ``exec`` all apply.
    """
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["HOSTNAME"] = hostname
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{argv} failed: {proc.stderr}"
    return json.loads(proc.stdout) if proc.stdout else None


def container_env(svc: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """The service's ``environment``, interpolated, as the container sees it."""
    environment = interpolate(svc.get("environment", {}), env)
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in environment.items() if v is not None}


def parse_kvrelay(
    words: list[str], service: str, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """kvrelay's own argparse over ``words`` with the container's environment ``environ``;
    a rejected flag or variable fails with argparse's message."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_args(words, environ={} if environ is None else environ)
    except SystemExit:
        pytest.fail(f"service {service!r}: kvrelay rejects {words}:\n{captured.getvalue()}")


# ---------------------------------------------------------------------------- the tools


def test_compose_matches_compose_spec_schema() -> None:
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    schema = ["--builtin-schema", "vendor.compose-spec"]
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *schema, str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_loads_in_docker_compose(tmp_path: Path) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip(
            "docker-compose is not installed "
            "(apt-get install -y --no-install-recommends docker-compose)"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "COMPOSE_"))}
    proc = subprocess.run(
        [exe, "--project-directory", str(ROOT), "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- the file


def test_bare_up_starts_redis_model_init_router_and_one_worker_pair() -> None:
    services = load_compose()["services"]
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == DEFAULT_SERVICES
    for one_shot in ONE_SHOTS:
        assert services[one_shot]["restart"] == "no"
    for name in ("router", "prefill", "decode"):
        deps = services[name]["depends_on"]
        for one_shot in ONE_SHOTS:
            assert deps[one_shot]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_workers_get_the_redis_service_as_their_l2_tier() -> None:
    services = load_compose()["services"]
    for name in ("prefill", "decode", "prefill-gpu", "decode-gpu"):
        env = container_env(services[name], {})
        assert env["KVRELAY_REDIS_URL"] == "redis://redis:6379/0", name


def test_every_kvrelay_image_is_built_by_exactly_one_service() -> None:
    by_image: dict[str, list[str]] = {}
    for name, svc in kvrelay_services(load_compose()).items():
        by_image.setdefault(svc["image"], [])
        if "build" in svc:
            by_image[svc["image"]].append(name)
    assert by_image, "no kvrelay service in compose.yaml"
    for image, builders in by_image.items():
        assert len(builders) == 1, f"{image} is built by {builders or 'no service'}"


def test_serving_services_mount_the_models_read_only() -> None:
    for name, svc in kvrelay_services(load_compose()).items():
        if name in ONE_SHOTS:
            continue
        mounts = [v.split(":") for v in interpolate(svc["volumes"], {})]
        assert any(m[1] == "/models" and m[2:] == ["ro"] for m in mounts), (name, mounts)


def test_every_serving_service_holds_the_secret_and_publishes_no_cluster_port() -> None:
    compose = load_compose()
    secret = compose["services"]["secret"]
    writes = interpolate(secret["command"], {})[-1]
    assert "kvrelay secret --out /secrets/cluster.key" in writes
    assert any(v.split(":")[1] == "/secrets" for v in secret["volumes"])
    for name, svc in kvrelay_services(compose).items():
        if name in ONE_SHOTS:
            continue
        env = container_env(svc, {})
        assert env.get("KVRELAY_CLUSTER_SECRET_FILE") == "/secrets/cluster.key", name
        assert "KVRELAY_INSECURE_NO_AUTH" not in env, name
        mounts = [v.split(":") for v in interpolate(svc["volumes"], {})]
        assert ["secrets", "/secrets", "ro"] in mounts, (name, mounts)
        published = [str(p).rsplit(":", 1)[-1] for p in interpolate(svc.get("ports", []), {})]
        assert set(published) <= {"8000"}, f"{name} publishes {published}: only the HTTP API"


def test_every_kvrelay_command_parses(tmp_path: Path, fake_kvrelay: Path) -> None:
    services = kvrelay_services(load_compose())
    assert services.keys() >= {"model-init", "router", "prefill", "decode"}
    for name, svc in services.items():
        argv = mount_paths(service_argv(svc, {}), svc, tmp_path)
        words = kvrelay_words(argv, fake_kvrelay, hostname="0123456789ab")
        assert words, f"service {name!r} does not run kvrelay: {argv}"
        parse_kvrelay(words, name, container_env(svc, {}))


def test_containers_get_only_kvrelay_variables_kvrelay_knows() -> None:
    seen = set()
    for name, svc in kvrelay_services(load_compose()).items():
        for var in container_env(svc, {}):
            if var.startswith("KVRELAY_"):
                assert var in envs.BY_NAME, f"service {name!r}: kvrelay does not read {var}"
                seen.add(var)
    assert {"KVRELAY_MODEL", "KVRELAY_CONTROL_ADDR", "KVRELAY_ADMIN_TOKEN"} <= seen


def test_serving_services_need_no_shell() -> None:
    for name, svc in kvrelay_services(load_compose()).items():
        if svc.get("restart") != "no":  # the one-shots test for their file first
            assert "entrypoint" not in svc, f"service {name!r} replaces the kvrelay entrypoint"
            assert service_argv(svc, {})[:2] == [*IMAGE_ENTRYPOINT, "serve"], name


def test_workers_share_memory_and_stay_unique_when_scaled(fake_kvrelay: Path) -> None:
    compose = load_compose()
    services = kvrelay_services(compose)
    workers = {n: s for n, s in services.items() if s.get("ipc", "").startswith("service:")}
    assert workers.keys() >= {"prefill", "decode"}
    host_ids = set()
    for name, svc in workers.items():
        owner = svc["ipc"].removeprefix("service:")
        assert compose["services"][owner].get("ipc") == "shareable", owner
        assert "shm_size" in compose["services"][owner], owner
        environ = container_env(svc, {})
        replicas = [
            worker_identity(
                parse_kvrelay(
                    kvrelay_words(service_argv(svc, {}), fake_kvrelay, host) or [], name, environ
                ),
                host,
            )
            for host in ("aaaaaaaaaaaa", "bbbbbbbbbbbb")
        ]
        assert replicas[0].role.value in ("prefill", "decode")
        assert_shell_execs_kvrelay(service_argv(svc, {}), name)
        assert replicas[0].instance_id != replicas[1].instance_id, name
        assert replicas[0].advertise_host != replicas[1].advertise_host, name
        if environ.get("KVRELAY_DEVICE", "cpu") == "cpu":
            assert replicas[0].transport != "tcp", name  # CPU pools: shared memory
        else:  # a GPU per container: CUDA IPC cannot open the other's pool
            assert replicas[0].transport == "tcp", name
        host_ids |= {r.host_id for r in replicas}
    assert len(host_ids) == 1 and "" not in host_ids, f"workers need one --host-id: {host_ids}"


def worker_identity(args: argparse.Namespace, hostname: str) -> WorkerConfig:
    """The worker's settings with the id and address it derives in a container named
    ``hostname`` (pid 1, as under ``init: true`` every container's first process)."""
    config = WorkerConfig(
        role=Role(args.role),
        model=args.model,
        router_addr=args.control_addr,
        instance_id=args.instance_id,
        host=args.host,
        advertise_host=args.advertise_host,
        host_id=args.host_id,
        transport=args.transport,
    )
    return resolve_identity(config, hostname, pid=1)


def assert_shell_execs_kvrelay(argv: list[str], service: str) -> None:
    """A long-running ``sh -c`` must ``exec kvrelay``: sh would not pass SIGTERM on."""
    if Path(argv[0]).name not in ("sh", "bash") or argv[1:2] != ["-c"]:
        return
    assert re.search(r"(^|[;&|]\s*)exec\s+kvrelay\b", argv[2].strip()), (
        f"service {service!r}: {argv[2]!r} does not exec kvrelay"
    )


# ---------------------------------------------------------------------------- the processes


class ComposeRun:
    """Runs compose services as local processes: one set of free ports per service."""

    def __init__(self, compose: Mapping[str, Any], root: Path, bin_dir: Path) -> None:
        self.services = compose["services"]
        self.root = root
        self.bin_dir = bin_dir
        self.cluster_id = f"deploy{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ports: dict[str, dict[int, int]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.redis: RedisServer | None = None  # the redis service, as a real redis-server
        self.batches: list[list[str]] = []  # started together, in start order
        self.hostnames = {name: uuid.uuid4().hex[:12] for name in self.services}
        self.logs = root / "logs"
        self.logs.mkdir()

    def port(self, service: str, port: int) -> int:
        mapping = self.ports.setdefault(service, {})
        if port not in mapping:
            mapping[port] = free_port()
        return mapping[port]

    def local_words(self, name: str) -> list[str] | None:
        svc = self.services[name]
        argv = mount_paths(service_argv(svc, {}), svc, self.root)
        words = kvrelay_words(argv, self.bin_dir, hostname=self.hostnames[name])
        return None if words is None else self._localize(name, words)

    def _localize(self, name: str, words: list[str]) -> list[str]:
        """Container addresses to 127.0.0.1, ports to free ones, a cluster id of its own."""
        out = [part for word in words for part in _split_option(word)]
        for i, flag in enumerate(out[:-1]):
            out[i + 1] = self._localize_value(name, flag, out[i + 1])
        return out

    def _localize_value(self, name: str, flag: str, value: str) -> str:
        if flag in ("--host", "--advertise-host"):
            return "127.0.0.1"
        if flag in ("--port", "--status-port", "--peer-port") and value != "0":
            return str(self.port(name, int(value)))
        if flag == "--control-addr":
            host, _, port = value.removeprefix("tcp://").rpartition(":")
            owner = name if host in ("0.0.0.0", "*") else host
            return f"tcp://127.0.0.1:{self.port(owner, int(port))}"
        if flag == "--cluster-id":
            return self.cluster_id
        if flag == "--redis-url" and value:
            host, _, rest = value.removeprefix("redis://").partition(":")
            port, _, db = rest.partition("/")
            assert host in self.services, f"{name}: redis URL {value} names no service"
            return f"redis://127.0.0.1:{self.port(host, int(port))}/{db}"
        return value

    def healthcheck_argv(self, name: str) -> list[str]:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), test
        argv = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
        local = re.compile(r"(?:127\.0\.0\.1|localhost):(\d+)")
        return [local.sub(lambda m: f"127.0.0.1:{self.port(name, int(m[1]))}", a) for a in argv]

    def start(self, name: str) -> None:
        words = self.local_words(name)
        assert words is not None, f"{name} runs no kvrelay command"
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "kvrelay", *words],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(name),
                start_new_session=True,
            )

    def start_redis(self) -> None:
        """The redis service as a local redis-server on its port (skips where none)."""
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        # what the one-shot redis-secret does (it runs no kvrelay): a password in its volume,
        # which Redis requires and the workers read (KVRELAY_REDIS_PASSWORD_FILE)
        secret = self.root / "run/kvrelay/redis/password"
        secret.parent.mkdir(parents=True, exist_ok=True)
        password = secrets.token_hex(16)
        secret.write_text(password)
        self.redis = RedisServer(self.root, port=self.port("redis", 6379), password=password)
        self.redis.start()

    def env(self, name: str) -> dict[str, str]:
        """The service's ``environment`` (interpolated, its ``KVRELAY_*`` settings localized
        like the flags) over this process's, less any ``KVRELAY_*`` of the test's own."""
        svc = self.services[name]
        environment = container_env(svc, {})
        for var, value in environment.items():
            if var in envs.BY_NAME and envs.BY_NAME[var].flag:
                (local,) = mount_paths([value], svc, self.root)
                environment[var] = self._localize_value(name, envs.BY_NAME[var].flag, local)
        outer = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
        return {**outer, **environment}

    def wait_healthy(self, name: str, timeout: float = 60.0) -> None:
        argv = self.healthcheck_argv(name)
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.procs[name].poll()
            assert code is None, f"{name} exited with {code}:\n{self.log(name)}"
            check = subprocess.run(argv, capture_output=True, timeout=30)
            if check.returncode == 0:
                return
            time.sleep(0.3)
        pytest.fail(f"{name}: healthcheck {argv} never passed:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self, grace: float = 10.0) -> None:
        """Like ``docker compose down``: SIGTERM, SIGKILL after ``grace``; dependents first."""
        stubborn = []
        for batch in reversed(self.batches):
            procs = {n: self.procs.pop(n) for n in batch if n in self.procs}
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for name, proc in procs.items():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    stubborn.append(name)
        assert not stubborn, f"{stubborn} ignored SIGTERM for {grace}s"


def _split_option(word: str) -> list[str]:
    """``--flag=value`` as two words, so either spelling is rewritten."""
    flag, eq, value = word.partition("=")
    return [flag, value] if word.startswith("--") and eq else [word]


def start_order(services: Mapping[str, Any]) -> list[list[str]]:
    """Default-profile services in ``depends_on`` order: batches that start together."""
    todo = {n: set(s.get("depends_on", {})) for n, s in services.items() if not s.get("profiles")}
    done: set[str] = set()
    batches: list[list[str]] = []
    while todo:
        batch = sorted(n for n, deps in todo.items() if deps <= done)
        assert batch, f"depends_on has a cycle or an unknown service: {todo}"
        batches.append(batch)
        done.update(batch)
        for n in batch:
            del todo[n]
    return batches


@contextlib.contextmanager
def compose_up(tmp_path: Path, bin_dir: Path) -> Iterator[ComposeRun]:
    compose = load_compose()
    run = ComposeRun(compose, tmp_path, bin_dir)
    kvrelay = kvrelay_services(compose)
    try:
        for batch in start_order(compose["services"]):
            if "redis" in batch:
                run.start_redis()
            names = [n for n in batch if n in kvrelay]
            run.batches.append(names)
            for name in names:
                if compose["services"][name].get("restart") == "no":
                    run_one_shot(run, name)
                else:
                    run.start(name)
            for name in names:
                if name in run.procs and "healthcheck" in compose["services"][name]:
                    run.wait_healthy(name)
        yield run
    finally:
        run.stop()
        if run.redis is not None:
            run.redis.stop()
        leftover = cleanup_segments(f"kvrelay-{run.cluster_id}-")
    assert leftover == [], f"shared memory left behind: {leftover}"


def run_one_shot(run: ComposeRun, name: str) -> None:
    """A ``restart: "no"`` service runs to completion, and is a no-op when run again."""
    words = run.local_words(name)
    assert words is not None, f"{name} runs no kvrelay command"
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", *words], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{name} failed: {proc.stderr[-3000:]}"
    assert run.local_words(name) is None, f"{name} runs kvrelay again once its work is done"


@pytest.mark.timeout(180)
def test_compose_services_serve_a_completion(tmp_path: Path, fake_kvrelay: Path) -> None:
    with compose_up(tmp_path, fake_kvrelay) as run:
        router = f"http://127.0.0.1:{run.port('router', 8000)}"
        deadline = time.monotonic() + 30
        while httpx.get(f"{router}/ready", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "router never became ready"
            time.sleep(0.2)
        res = httpx.post(
            f"{router}/v1/completions",
            json={
                "model": "smollm2",
                "prompt": "The cache moves to the decode worker. " * 4,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=30,
        )
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["text"]
        metrics = httpx.get(f"http://127.0.0.1:{run.port('decode', 8001)}/metrics", timeout=5)
        shm_bytes = metric_value(metrics.text, "kvrelay_kv_transfer_bytes_total", transport="shm")
        assert shm_bytes > 0, "the KV hand-off did not use shared memory"
        assert run.redis is not None
        with run.redis.client() as redis_client:  # the workers got the redis service's URL
            deadline = time.monotonic() + 30
            while redis_client.dbsize() == 0:  # written behind the request path
                assert time.monotonic() < deadline, "no worker wrote a KV block to redis"
                time.sleep(0.2)


# ---------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            op, _, args = pending.strip().partition(" ")
            out.append((op.upper(), args.strip()))
            pending = ""
    return out


def readme_torch_pin() -> str:
    match = re.search(r"pip install (torch==[\w.]+)", (ROOT / "README.md").read_text())
    assert match, "README.md names no torch pin"
    return match.group(1)


def test_dockerfile_builds_the_image_compose_runs() -> None:
    steps = dockerfile_instructions()
    ops = [op for op, _ in steps]
    args = {args.split("=")[0]: args.partition("=")[2] for op, args in steps if op == "ARG"}
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    stages = [a.split() for op, a in steps if op == "FROM"]
    assert stages[0] == ["${BASE_IMAGE}", "AS", "base"], "every stage starts from BASE_IMAGE"
    assert all(stage[0] == "base" for stage in stages[1:])
    assert args["TORCH_SPEC"] == readme_torch_pin() == "torch==2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [a for op, a in steps if op == "RUN"]
    torch_step = next(r for r in runs if '"${TORCH_SPEC}"' in r and "pip install" in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_step
    wheel_step = next(r for r in runs if re.search(r"pip wheel .*/src\b", r))
    assert "_kvcopy" in wheel_step, "the build stage must fail if the native library is missing"
    source_step = next(r for r in runs if re.search(r"pip install .*/wheels/kvrelay-", r))
    assert "--constraint" in source_step, "pip install of the source may replace torch"
    assert "[k8s]" in source_step, "the router's kubernetes scaling hook needs the k8s extra"
    assert stages[-1] == ["base"], "the final image is not the build stage (no compiler in it)"
    user = [a for op, a in steps if op == "USER"]
    assert user and user[-1] not in ("root", "0"), "the image must not run as root"
    assert ops.index("USER") < ops.index("ENTRYPOINT")
    entrypoint = next(a for op, a in steps if op == "ENTRYPOINT")
    assert json.loads(entrypoint) == IMAGE_ENTRYPOINT
    exposed = {int(p) for op, a in steps if op == "EXPOSE" for p in a.split()}
    assert exposed >= {8000, 8001, 8002, 5557}


def test_dockerfile_copies_files_that_the_build_context_keeps() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    sources = [
        src
        for op, a in dockerfile_instructions()
        if op == "COPY" and not a.startswith("--from=")  # those come from a build stage
        for src in a.split()[:-1]
        if not src.startswith("--")
    ]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert src not in ignored, f"COPY {src}: excluded by .dockerignore"
