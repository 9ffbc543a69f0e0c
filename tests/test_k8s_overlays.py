"""The kustomize overlays in ``deploy/k8s/overlays/``, rendered and checked offline.

Rendered by ``tests/kustomize_lite.py`` (the subset of ``kustomize build`` they use; it
refuses any other field). Every rendered object of every overlay validates strictly against
the Kubernetes 1.30 schemas (the PodMonitors, a CRD, against their own fields); every kvrelay
command parses with kvrelay's own parser in its container's environment; and what
production needs holds: several routers every worker registers with, Redis with a password
as the L2 tier, required Secrets, the SIGTERM drain within the grace period, disruption
budgets that select real pods, spreading, a pinned image, a downloaded model; the GPU
overlay asks for GPUs the way the NVIDIA device plugin expects.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from kvrelay import envs
from kvrelay.cli import parse_args
from tests.kustomize_lite import build
from tests.test_k8s_manifests import (
    K8S_DIR,
    K8S_VERSION,
    SAMPLE_FIELDS,
    SAMPLE_SECRET,
    expand,
    kvrelay_words,
)

OVERLAYS = K8S_DIR / "overlays"
NAMES = ("production", "gpu", "monitoring")
VERSION = tomllib.loads((K8S_DIR.parents[1] / "pyproject.toml").read_text())["project"]["version"]
_VAR = re.compile(r"\$\((\w+)\)")


def render(name: str) -> list[dict[str, Any]]:
    return build(OVERLAYS / name)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def container_env(objects: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """As the kubelet builds it: ConfigMaps, then env in order with $(VAR) expansion."""
    configmaps = {n: o.get("data", {}) for n, o in by_kind(objects, "ConfigMap").items()}
    out: dict[str, str] = {}
    for source in c.get("envFrom", []):
        out.update(configmaps[source["configMapRef"]["name"]])
    for item in c.get("env", []):
        ref = item.get("valueFrom", {})
        assert ("value" in item) != bool(ref), f"env {item['name']}: value and valueFrom"
        if "value" in item:
            out[item["name"]] = expand(item["value"], out)
        elif "fieldRef" in ref:
            out[item["name"]] = SAMPLE_FIELDS[ref["fieldRef"]["fieldPath"]]
        else:
            assert "secretKeyRef" in ref, item
            out[item["name"]] = SAMPLE_SECRET
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_object_validates_against_kubernetes_schema(name: str) -> None:
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    import kubernetes_validate

    for obj in render(name):
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "PodMonitor":
            check_pod_monitor(obj)
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.path))}")
        assert obj["metadata"].get("namespace", "kvrelay") == "kvrelay", where


def check_pod_monitor(obj: dict[str, Any]) -> None:
    """The fields of monitoring.coreos.com/v1 PodMonitor used here (no schema ships for it)."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(obj["spec"]) == {"selector", "podMetricsEndpoints"}
    for endpoint in obj["spec"]["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "honorLabels"}
        assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize("name", NAMES)
def test_every_kvrelay_command_parses_in_its_environment(name: str) -> None:
    objects = render(name)
    for obj in workloads(objects):
        c = container(obj)
        if not c["image"].startswith("kvrelay"):
            continue
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        env = container_env(objects, c)
        unknown = {k for k in env if k.startswith("KVRELAY_") and k not in envs.BY_NAME}
        assert not unknown, f"{where}: kvrelay does not read {sorted(unknown)}"
        argv = [expand(w, env) for w in [*c.get("command", []), *c.get("args", [])]]
        words = kvrelay_words(argv)
        assert words is not None, f"{where} runs no kvrelay command"
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                parse_args(words, environ=env)
        except SystemExit:
            pytest.fail(f"{where}: kvrelay rejects {words}:\n{captured.getvalue()}")


def serve_args(objects: list[dict[str, Any]], kind: str, name: str) -> Any:
    c = container(by_kind(objects, kind)[name])
    env = container_env(objects, c)
    words = kvrelay_words([expand(w, env) for w in c["command"]])
    assert words is not None
    return parse_args(words, environ=env)


def test_every_worker_registers_with_every_router_by_its_stable_name() -> None:
    objects = render("production")
    assert "kvrelay-router" not in by_kind(objects, "Deployment")  # the StatefulSet instead
    routers = by_kind(objects, "StatefulSet")["kvrelay-router"]["spec"]
    control = by_kind(objects, "Service")[routers["serviceName"]]["spec"]
    assert (control["clusterIP"], control["publishNotReadyAddresses"]) == ("None", True)
    assert [p["port"] for p in control["ports"]] == [5557]
    want = [
        f"tcp://kvrelay-router-{i}.{routers['serviceName']}:5557"
        for i in range(routers["replicas"])
    ]
    assert routers["replicas"] >= 2
    router = serve_args(objects, "StatefulSet", "kvrelay-router")
    assert (router.control_addr, router.autoscale) == ("tcp://0.0.0.0:5557", "off")
    for role in ("prefill", "decode"):
        args = serve_args(objects, "Deployment", f"kvrelay-{role}")
        assert args.control_addr.split(",") == want, role


def test_workers_use_redis_with_the_secrets_password() -> None:
    objects = render("production")
    redis = by_kind(objects, "StatefulSet")["kvrelay-redis"]["spec"]
    (claim,) = redis["volumeClaimTemplates"]
    redis_c = container(by_kind(objects, "StatefulSet")["kvrelay-redis"])
    assert ":latest" not in redis_c["image"] and ":" in redis_c["image"]
    assert {m["name"] for m in redis_c["volumeMounts"]} == {claim["metadata"]["name"]}
    args = redis_c["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    (password,) = [e for e in redis_c["env"] if e["name"] == "REDIS_PASSWORD"]
    secret = password["valueFrom"]["secretKeyRef"]
    service = by_kind(objects, "Service")["kvrelay-redis"]["spec"]
    for role in ("prefill", "decode"):
        c = container(by_kind(objects, "Deployment")[f"kvrelay-{role}"])
        (worker_password,) = [e for e in c["env"] if e["name"] == "REDIS_PASSWORD"]
        assert worker_password["valueFrom"]["secretKeyRef"] == secret
        args = serve_args(objects, "Deployment", f"kvrelay-{role}")
        url = f"redis://:{SAMPLE_SECRET}@kvrelay-redis:{service['ports'][0]['port']}/0"
        assert args.redis_url == url, role


def test_secrets_are_required() -> None:
    objects = render("production")
    for obj in workloads(objects):
        for item in container(obj).get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            assert ref is None or not ref.get("optional", False), item
    router = serve_args(objects, "StatefulSet", "kvrelay-router")
    assert router.admin_token == SAMPLE_SECRET
    for kind, name in (
        ("StatefulSet", "kvrelay-router"),
        ("Deployment", "kvrelay-prefill"),
        ("Deployment", "kvrelay-decode"),
    ):
        pod = by_kind(objects, kind)[name]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        secret = volumes["cluster-credential"]["secret"]
        assert secret["secretName"] == "kvrelay-cluster-secret" and not secret.get("optional")
    router = container(by_kind(objects, "StatefulSet")["kvrelay-router"])
    env = container_env(objects, router)
    assert env["KVRELAY_CLUSTER_SECRET_FILE"] == "/etc/kvrelay/cluster/secret"


def test_termination_leaves_room_for_the_drain() -> None:
    objects = render("production")
    drain_s = float(
        by_kind(objects, "ConfigMap")["kvrelay-config"]["data"]["KVRELAY_DRAIN_TIMEOUT"]
    )
    router_pod = by_kind(objects, "StatefulSet")["kvrelay-router"]["spec"]["template"]["spec"]
    pre_stop = container(by_kind(objects, "StatefulSet")["kvrelay-router"])["lifecycle"]["preStop"]
    pause_s = float(pre_stop["exec"]["command"][-1].removeprefix("sleep "))
    assert router_pod["terminationGracePeriodSeconds"] > pause_s + drain_s
    for role in ("prefill", "decode"):
        pod = by_kind(objects, "Deployment")[f"kvrelay-{role}"]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > drain_s
        args = serve_args(objects, "Deployment", f"kvrelay-{role}")
        assert args.drain_timeout == drain_s


def test_disruption_budgets_and_spreading_select_each_roles_pods() -> None:
    objects = render("production")
    budgets = by_kind(objects, "PodDisruptionBudget")
    pods = {
        "router": by_kind(objects, "StatefulSet")["kvrelay-router"],
        "prefill": by_kind(objects, "Deployment")["kvrelay-prefill"],
        "decode": by_kind(objects, "Deployment")["kvrelay-decode"],
    }
    assert set(budgets) == {f"kvrelay-{role}" for role in pods}
    for role, obj in pods.items():
        labels = obj["spec"]["template"]["metadata"]["labels"]
        selector = budgets[f"kvrelay-{role}"]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items() and selector["app.kubernetes.io/component"]
        spec = obj["spec"]["template"]["spec"]
        (anti,) = spec["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == labels
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"] == labels


@pytest.mark.parametrize("name,tag", [("production", VERSION), ("gpu", f"{VERSION}-cuda")])
def test_images_are_pinned_to_the_release(name: str, tag: str) -> None:
    for obj in workloads(render(name)):
        image = container(obj)["image"]
        if image.startswith("kvrelay"):
            assert image == f"kvrelay:{tag}", obj["metadata"]["name"]


def test_the_model_is_downloaded_where_the_pods_read_it() -> None:
    objects = render("production")
    job = container(by_kind(objects, "Job")["kvrelay-model-init"])
    words = kvrelay_words(job["command"])
    assert words == ["model", "get", "smollm2-135m-instruct", "/models/smollm2"]
    model = by_kind(objects, "ConfigMap")["kvrelay-config"]["data"]["KVRELAY_MODEL"]
    assert model == "/models/smollm2"
    assert serve_args(objects, "Deployment", "kvrelay-decode").model == model


def test_gpu_workers_ask_for_one_gpu_each() -> None:
    objects = render("gpu")
    for role in ("prefill", "decode"):
        obj = by_kind(objects, "Deployment")[f"kvrelay-{role}"]
        pod = obj["spec"]["template"]["spec"]
        c = container(obj)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert pod["runtimeClassName"] == "nvidia"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        args = serve_args(objects, "Deployment", f"kvrelay-{role}")
        assert (args.device, args.transport) == ("cuda", "tcp")
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_pod_monitors_scrape_named_ports_of_real_pods() -> None:
    objects = render("monitoring")
    monitors = by_kind(objects, "PodMonitor")
    ports = {
        role: {p["name"] for p in container(obj)["ports"]}
        for role, obj in (
            ("router", by_kind(objects, "StatefulSet")["kvrelay-router"]),
            ("prefill", by_kind(objects, "Deployment")["kvrelay-prefill"]),
            ("decode", by_kind(objects, "Deployment")["kvrelay-decode"]),
        )
    }
    (router_endpoint,) = monitors["kvrelay-router"]["spec"]["podMetricsEndpoints"]
    assert router_endpoint["port"] in ports["router"]
    (worker_endpoint,) = monitors["kvrelay-workers"]["spec"]["podMetricsEndpoints"]
    assert worker_endpoint["port"] in ports["prefill"] & ports["decode"]


def test_the_base_kustomization_lists_every_manifest() -> None:
    spec = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(spec["resources"]) == files


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        build(tmp_path)
