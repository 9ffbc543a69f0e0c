"""The scaling hooks against real processes and real HTTP servers on loopback.

- ``webhook``: an ``http.server`` receiver in a thread records every request and answers
  with scripted statuses; the hook is the real httpx path.
- ``exec`` / ``compose``: real subprocesses; ``compose`` runs a stand-in for ``docker`` that
  records its argv.
- ``kubernetes``: the official client, configured from a kubeconfig file the test writes,
  talks to an ``http.server`` playing the API server's scale subresource.
- ``registry``: names, errors, and that importing it loads no hook module.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvrelay.autoscale.base import HookError, ScaleDecision
from kvrelay.autoscale.registry import HOOK_NAMES, create_hook

DECISION = ScaleDecision(
    prefill=2,
    decode=3,
    reasons=("prefill 1->2: TTFT attainment 80% < 90%", "decode 1->3: TPOT attainment 71% < 90%"),
    current_prefill=1,
    current_decode=1,
    drain=(),
    forced=True,
    timestamp=1700000000.25,
)


class Recorded(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes


class LoopbackServer:
    """An ``http.server`` on 127.0.0.1 in a thread; ``respond(method, path, body)`` answers.

    ``respond`` returns ``(status, json_body)``; every request is appended to ``requests``.
    """

    def __init__(self, respond: Callable[[str, str, bytes], tuple[int, Any]]) -> None:
        self.requests: list[Recorded] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                server.requests.append(Recorded(self.command, self.path, headers, body))
                status, payload = respond(self.command, self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _handle

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- webhook


@pytest.fixture
def receiver() -> Iterator[tuple[LoopbackServer, list[int]]]:
    """A webhook receiver answering the statuses in the list in turn (200 once it is empty)."""
    statuses: list[int] = []

    def respond(method: str, path: str, body: bytes) -> tuple[int, Any]:
        status = statuses.pop(0) if statuses else 200
        return status, {"ok": status < 400}

    server = LoopbackServer(respond)
    yield server, statuses
    server.stop()


def test_webhook_posts_the_decision_as_json_with_bearer_token(receiver) -> None:
    server, _ = receiver
    hook = create_hook("webhook", url=f"{server.url}/scale", token="s3cret", timeout=5)
    hook.apply(DECISION)

    assert len(server.requests) == 1
    req = server.requests[0]
    assert (req.method, req.path) == ("POST", "/scale")
    assert req.headers["authorization"] == "Bearer s3cret"
    assert req.headers["content-type"] == "application/json"
    assert json.loads(req.body) == {
        "prefill": 2,
        "decode": 3,
        "reasons": [
            "prefill 1->2: TTFT attainment 80% < 90%",
            "decode 1->3: TPOT attainment 71% < 90%",
        ],
        "current_prefill": 1,
        "current_decode": 1,
        "drain": [],
        "forced": True,
        "timestamp": 1700000000.25,
        "source": "kvrelay-autoscaler",
    }


def test_webhook_without_token_sends_no_authorization(receiver) -> None:
    server, _ = receiver
    create_hook("webhook", url=server.url, timeout=5).apply(DECISION)
    assert [r.method for r in server.requests] == ["POST"]
    assert "authorization" not in server.requests[0].headers


def test_webhook_retries_a_503_then_succeeds(receiver) -> None:
    server, statuses = receiver
    statuses.extend([503, 502])
    hook = create_hook("webhook", url=server.url, timeout=5, attempts=3, backoff=0.01)
    hook.apply(DECISION)
    assert len(server.requests) == 3
    assert len({r.body for r in server.requests}) == 1  # the same body every time


def test_webhook_gives_up_after_its_attempts_on_5xx(receiver) -> None:
    server, statuses = receiver
    statuses.extend([503] * 5)
    hook = create_hook("webhook", url=server.url, timeout=5, attempts=3, backoff=0.01)
    with pytest.raises(HookError, match=r"after 3 attempt\(s\): HTTP 503"):
        hook.apply(DECISION)
    assert len(server.requests) == 3


def test_webhook_4xx_is_not_retried(receiver) -> None:
    server, statuses = receiver
    statuses.append(400)
    hook = create_hook("webhook", url=server.url, timeout=5, attempts=3, backoff=0.01)
    with pytest.raises(HookError, match="refused the decision: HTTP 400"):
        hook.apply(DECISION)
    assert len(server.requests) == 1


def test_webhook_unreachable_fails_after_retries_within_timeout() -> None:
    hook = create_hook(
        "webhook", url=f"http://127.0.0.1:{closed_port()}/", timeout=3, attempts=3, backoff=0.05
    )
    start = time.monotonic()
    with pytest.raises(HookError, match=r"after 3 attempt\(s\): ConnectError"):
        hook.apply(DECISION)
    assert time.monotonic() - start < 3.5


def test_webhook_timeout_bounds_retries_and_backoff(receiver) -> None:
    server, statuses = receiver
    statuses.extend([503] * 10)
    hook = create_hook("webhook", url=server.url, timeout=0.5, attempts=10, backoff=1.0)
    start = time.monotonic()
    with pytest.raises(HookError, match="HTTP 503"):
        hook.apply(DECISION)
    assert time.monotonic() - start < 1.5
    assert len(server.requests) == 1  # the first backoff (1 s) does not fit in 0.5 s


@pytest.mark.parametrize(
    "options",
    [{"url": "ftp://x"}, {"url": "http://x", "timeout": 0}, {"url": "http://x", "attempts": 0}],
)
def test_webhook_rejects_bad_options(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        create_hook("webhook", **options)


# ---------------------------------------------------------------------------- exec

_DUMP_ENV = (
    "import json, os, sys\n"
    "keep = {k: v for k, v in os.environ.items() if k.startswith(('KVRELAY_', 'HOOK_TEST_'))}\n"
    "json.dump(keep, open(sys.argv[1], 'w'))\n"
)


def test_exec_passes_the_decision_in_env_over_the_inherited_env(tmp_path, monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVRELAY_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOOK_TEST_INHERITED", "yes")
    monkeypatch.setenv("KVRELAY_PREFILL", "99")  # the decision wins
    out = tmp_path / "env.json"
    decision = ScaleDecision(
        prefill=1,
        decode=0,
        reasons=("decode 2->0: idle", "prefill 2->1: idle"),
        current_prefill=2,
        current_decode=2,
        drain=("prefill-b", "decode-a", "decode-b"),
    )
    create_hook("exec", command=[sys.executable, "-c", _DUMP_ENV, str(out)]).apply(decision)
    assert json.loads(out.read_text()) == {
        "HOOK_TEST_INHERITED": "yes",
        "KVRELAY_PREFILL": "1",
        "KVRELAY_DECODE": "0",
        "KVRELAY_CURRENT_PREFILL": "2",
        "KVRELAY_CURRENT_DECODE": "2",
        "KVRELAY_DRAIN": "prefill-b,decode-a,decode-b",
        "KVRELAY_REASONS": "decode 2->0: idle\nprefill 2->1: idle",
        "KVRELAY_FORCED": "0",
    }


def test_exec_runs_a_string_through_the_shell(tmp_path) -> None:
    out = tmp_path / "out.txt"
    hook = create_hook("exec", command=f'echo "$KVRELAY_PREFILL/$KVRELAY_DECODE" > {out}')
    hook.apply(DECISION)
    assert out.read_text() == "2/3\n"


def test_exec_nonzero_exit_is_a_hook_error_with_stderr() -> None:
    script = "import sys; sys.stderr.write('quota exceeded'); sys.exit(3)"
    hook = create_hook("exec", command=[sys.executable, "-c", script])
    with pytest.raises(HookError, match="exited with status 3: quota exceeded"):
        hook.apply(DECISION)


def test_exec_missing_program_is_a_hook_error(tmp_path) -> None:
    with pytest.raises(HookError, match="cannot run"):
        create_hook("exec", command=[str(tmp_path / "no-such-program")]).apply(DECISION)


def _is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_exec_timeout_kills_the_command_and_its_children(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    hook = create_hook("exec", command=f"sleep 30 & echo $! > {pid_file}; wait", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(HookError, match=r"did not finish within 0\.5 s"):
        hook.apply(DECISION)
    assert time.monotonic() - start < 5
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_running(child)


# ---------------------------------------------------------------------------- compose


def stand_in(tmp_path: Path, body: str) -> Path:
    """An executable Python script at ``tmp_path/docker`` with ``body``."""
    script = tmp_path / "docker"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
    script.chmod(0o755)
    return script


def test_compose_runs_up_with_the_scale_of_each_role(tmp_path) -> None:
    argv_file = tmp_path / "argv.json"
    docker = stand_in(tmp_path, f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))")
    hook = create_hook(
        "compose", file="/srv/kv/compose.yaml", project="kvrelay", command=[str(docker), "compose"]
    )
    hook.apply(DECISION)
    assert json.loads(argv_file.read_text()) == [
        "compose",
        "-p", "kvrelay",
        "-f", "/srv/kv/compose.yaml",
        "up", "-d",
        "--scale", "prefill=2",
        "--scale", "decode=3",
        "--no-recreate",
    ]  # fmt: skip


def test_compose_uses_the_configured_service_names(tmp_path) -> None:
    argv_file = tmp_path / "argv.json"
    docker = stand_in(tmp_path, f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))")
    hook = create_hook(
        "compose",
        file="c.yaml",
        project="p",
        prefill_service="prefill-gpu",
        decode_service="decode-gpu",
        command=[str(docker)],
    )
    hook.apply(ScaleDecision(prefill=0, decode=1))
    assert json.loads(argv_file.read_text())[-5:] == [
        "--scale", "prefill-gpu=0", "--scale", "decode-gpu=1", "--no-recreate",
    ]  # fmt: skip


def test_compose_failure_is_a_hook_error_with_its_stderr(tmp_path) -> None:
    docker = stand_in(tmp_path, "sys.stderr.write('no such service: prefill\\n'); sys.exit(1)")
    hook = create_hook("compose", file="c.yaml", project="p", command=[str(docker), "compose"])
    with pytest.raises(HookError, match="exited with status 1: no such service: prefill"):
        hook.apply(DECISION)


def test_compose_requires_file_and_project() -> None:
    with pytest.raises(ValueError, match="'project'"):
        create_hook("compose", file="c.yaml", project="")


# ---------------------------------------------------------------------------- kubernetes

NAMESPACE = "kvrelay-test"
TOKEN = "test-token-123"


class FakeApiServer(LoopbackServer):
    """Just enough of the API server: the scale subresource of Deployments in ``NAMESPACE``.

    ``replicas`` holds each Deployment's ``spec.replicas``; a PATCH merges into it.
    ``annotations`` holds each pod's annotations; a PATCH of a pod merges into them.
    ``forbid_patch`` answers every PATCH with 403, as RBAC without ``patch`` would.
    """

    def __init__(self, replicas: dict[str, int], pods: tuple[str, ...] = ()) -> None:
        self.replicas = replicas
        self.annotations: dict[str, dict[str, str]] = {pod: {} for pod in pods}
        self.forbid_patch = False
        super().__init__(self._respond)

    def _respond(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods/"
        if path.startswith(pods):
            return self._respond_pod(method, path.removeprefix(pods), body)
        prefix = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/"
        name = path.removeprefix(prefix).removesuffix("/scale")
        if not (path.startswith(prefix) and path.endswith("/scale") and name in self.replicas):
            return 404, _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if method == "PATCH":
            if self.forbid_patch:
                message = (
                    f'deployments.apps "{name}" is forbidden: User "system:serviceaccount:'
                    f'{NAMESPACE}:kvrelay-autoscaler" cannot patch resource "deployments/scale"'
                )
                return 403, _status(403, "Forbidden", message)
            self.replicas[name] = json.loads(body)["spec"]["replicas"]
        return 200, _scale(name, self.replicas[name])

    def _respond_pod(self, method: str, name: str, body: bytes) -> tuple[int, Any]:
        if name not in self.annotations:
            return 404, _status(404, "NotFound", f'pods "{name}" not found')
        if method == "PATCH" and self.forbid_patch:
            message = f'pods "{name}" is forbidden: cannot patch resource "pods"'
            return 403, _status(403, "Forbidden", message)
        if method == "PATCH":
            self.annotations[name].update(json.loads(body)["metadata"]["annotations"])
        meta = {"name": name, "namespace": NAMESPACE, "annotations": self.annotations[name]}
        return 200, {"kind": "Pod", "apiVersion": "v1", "metadata": meta}


def _scale(name: str, replicas: int) -> dict[str, Any]:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": "1"},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": f"app.kubernetes.io/component={name}"},
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def write_kubeconfig(path: Path, server_url: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server_url}}],
        "users": [{"name": "autoscaler", "user": {"token": TOKEN}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "autoscaler"}}],
        "current-context": "fake",
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    pytest.importorskip(
        "kubernetes", reason="the kubernetes client is not installed (pip install kubernetes)"
    )
    server = FakeApiServer({"kvrelay-prefill": 1, "kvrelay-decode": 3})
    yield server
    server.stop()


def kubernetes_hook(api_server: FakeApiServer, tmp_path: Path, **options: Any):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api_server.url)
    return create_hook(
        "kubernetes", namespace=NAMESPACE, kubeconfig=str(kubeconfig), timeout=5, **options
    )


def scale_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/scale"


def test_kubernetes_patches_only_the_role_that_changes(api_server, tmp_path) -> None:
    hook = kubernetes_hook(api_server, tmp_path)
    hook.apply(DECISION)  # prefill 1 -> 2, decode stays 3
    hook.close()

    assert [(r.method, r.path) for r in api_server.requests] == [
        ("GET", scale_path("kvrelay-prefill")),
        ("GET", scale_path("kvrelay-decode")),
        ("PATCH", scale_path("kvrelay-prefill")),
    ]
    for req in api_server.requests:
        assert req.headers["authorization"] == f"Bearer {TOKEN}"
    patch = api_server.requests[2]
    assert patch.headers["content-type"] == "application/strategic-merge-patch+json"
    assert json.loads(patch.body) == {"spec": {"replicas": 2}}
    assert api_server.replicas == {"kvrelay-prefill": 2, "kvrelay-decode": 3}


def test_kubernetes_patches_both_roles_with_custom_names(tmp_path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    server = FakeApiServer({"pf": 4, "dc": 4})
    try:
        hook = kubernetes_hook(server, tmp_path, prefill_deployment="pf", decode_deployment="dc")
        hook.apply(ScaleDecision(prefill=1, decode=0, current_prefill=4, current_decode=4))
        hook.close()
    finally:
        server.stop()
    patches = [(r.path, json.loads(r.body)) for r in server.requests if r.method == "PATCH"]
    assert patches == [
        (scale_path("pf"), {"spec": {"replicas": 1}}),
        (scale_path("dc"), {"spec": {"replicas": 0}}),
    ]
    assert server.replicas == {"pf": 1, "dc": 0}


def test_kubernetes_gives_drained_pods_the_lowest_deletion_cost_before_scaling_down(
    tmp_path,
) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    from kvrelay.autoscale.hooks.kubernetes import DELETION_COST

    pods = ("kvrelay-decode-7f9-a", "kvrelay-decode-7f9-b", "kvrelay-decode-7f9-c")
    server = FakeApiServer({"kvrelay-prefill": 1, "kvrelay-decode": 3}, pods)
    drain = ("kvrelay-decode-7f9-b", "not-a-pod")  # the second: an instance with no pod
    try:
        hook = kubernetes_hook(server, tmp_path)
        hook.apply(ScaleDecision(1, 2, current_prefill=1, current_decode=3, drain=drain))
        hook.close()
    finally:
        server.stop()
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/"
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", scale_path("kvrelay-prefill")),
        ("GET", scale_path("kvrelay-decode")),
        ("PATCH", pod_path + "kvrelay-decode-7f9-b"),  # before the Deployment goes down
        ("PATCH", pod_path + "not-a-pod"),  # 404: skipped, the scale-down still happens
        ("PATCH", scale_path("kvrelay-decode")),
    ]
    assert server.requests[2].headers["content-type"] == "application/strategic-merge-patch+json"
    assert server.annotations == {
        "kvrelay-decode-7f9-a": {},
        "kvrelay-decode-7f9-b": {DELETION_COST: str(-(2**31))},
        "kvrelay-decode-7f9-c": {},
    }
    assert server.replicas == {"kvrelay-prefill": 1, "kvrelay-decode": 2}


def test_kubernetes_marks_no_pod_when_scaling_up(tmp_path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    server = FakeApiServer({"kvrelay-prefill": 1, "kvrelay-decode": 1}, ("p",))
    try:
        hook = kubernetes_hook(server, tmp_path)
        hook.apply(ScaleDecision(1, 2, current_prefill=1, current_decode=1, drain=("p",)))
        hook.close()
    finally:
        server.stop()
    assert [r.method for r in server.requests] == ["GET", "GET", "PATCH"]
    assert server.annotations == {"p": {}} and server.replicas["kvrelay-decode"] == 2


def test_kubernetes_forbidden_pod_patch_is_a_hook_error_and_nothing_scales(tmp_path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    server = FakeApiServer({"kvrelay-prefill": 1, "kvrelay-decode": 2}, ("p",))
    server.forbid_patch = True
    try:
        hook = kubernetes_hook(server, tmp_path)
        with pytest.raises(HookError, match=r"PATCH pods/p in namespace kvrelay-test: 403"):
            hook.apply(ScaleDecision(1, 1, current_prefill=1, current_decode=2, drain=("p",)))
        hook.close()
    finally:
        server.stop()
    assert server.replicas == {"kvrelay-prefill": 1, "kvrelay-decode": 2}


def test_kubernetes_sends_no_patch_when_nothing_changes(api_server, tmp_path) -> None:
    hook = kubernetes_hook(api_server, tmp_path)
    # The Deployments already ask for 1 and 3, whatever the router has counted.
    hook.apply(ScaleDecision(prefill=1, decode=3, current_prefill=0, current_decode=2))
    hook.close()
    assert [r.method for r in api_server.requests] == ["GET", "GET"]


def test_kubernetes_forbidden_is_a_hook_error(api_server, tmp_path) -> None:
    api_server.forbid_patch = True
    hook = kubernetes_hook(api_server, tmp_path)
    with pytest.raises(
        HookError, match=r"PATCH deployments/kvrelay-prefill/scale .*403.*forbidden"
    ):
        hook.apply(DECISION)
    hook.close()
    assert api_server.replicas == {"kvrelay-prefill": 1, "kvrelay-decode": 3}


def test_kubernetes_missing_deployment_is_a_hook_error(api_server, tmp_path) -> None:
    hook = kubernetes_hook(api_server, tmp_path, decode_deployment="kvrelay-nope")
    with pytest.raises(HookError, match=r"GET deployments/kvrelay-nope/scale .*404"):
        hook.apply(DECISION)
    hook.close()
    assert [r.method for r in api_server.requests] == ["GET", "GET"]


def test_kubernetes_unreachable_api_server_is_a_hook_error(tmp_path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{closed_port()}")
    hook = create_hook("kubernetes", kubeconfig=str(kubeconfig), timeout=3)
    start = time.monotonic()
    with pytest.raises(HookError, match="GET deployments/kvrelay-prefill/scale"):
        hook.apply(DECISION)
    assert time.monotonic() - start < 3.5
    hook.close()


def test_kubernetes_bad_kubeconfig_is_a_value_error(tmp_path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    with pytest.raises(ValueError, match="cannot load credentials"):
        create_hook("kubernetes", kubeconfig=str(tmp_path / "missing"))


# ---------------------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert HOOK_NAMES == ("local", "compose", "kubernetes", "webhook", "exec")


def test_registry_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'k8s'.*local, compose, kubernetes, webhook, exec"):
        create_hook("k8s")


def test_registry_creates_hooks_by_name() -> None:
    hook = create_hook("exec", command=["true"])
    assert (type(hook).__name__, hook.name) == ("ExecHook", "exec")


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_registry_entries_name_real_hook_classes(name: str) -> None:
    import importlib
    import importlib.util

    from kvrelay.autoscale.base import ScalingHook
    from kvrelay.autoscale.registry import _REGISTRY

    module_name, class_name = _REGISTRY[name]
    if name == "local" and importlib.util.find_spec(module_name) is None:
        pytest.skip("kvrelay/autoscale/hooks/local.py is not in this tree yet")
    if name == "kubernetes":
        pytest.importorskip("kubernetes", reason="the kubernetes client is not installed")
    cls = getattr(importlib.import_module(module_name), class_name)
    assert issubclass(cls, ScalingHook)
    assert cls.name == name


def test_a_missing_optional_dependency_names_the_extra(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "kvrelay.autoscale.hooks.kubernetes", raising=False)
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs 'kubernetes' \(pip install 'kvrelay\[k8s\]'\)"):
        create_hook("kubernetes")


_IMPORTED = (
    "import sys, json\n"
    "{setup}\n"
    "print(json.dumps(sorted(m for m in sys.modules if m == 'kubernetes' or m == 'httpx'"
    " or m.startswith(('kubernetes.', 'kvrelay.autoscale.hooks.')))))\n"
)


def _modules_after(setup: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTED.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(proc.stdout)


def test_importing_the_registry_imports_no_hook() -> None:
    assert _modules_after("import kvrelay.autoscale.registry") == []


def test_creating_a_hook_imports_only_that_hook() -> None:
    setup = (
        "from kvrelay.autoscale.registry import create_hook\ncreate_hook('exec', command=['true'])"
    )
    assert _modules_after(setup) == ["kvrelay.autoscale.hooks.exec"]
