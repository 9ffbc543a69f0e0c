"""The Kubernetes manifests in ``deploy/k8s/``, checked offline.

- Every object validates against the Kubernetes 1.30 OpenAPI schemas that
  ``kubernetes-validate`` ships (strict: an unknown field fails). Skips, naming how to
  install it, where it is missing; CI installs it through the ``test`` extra.
- Every kvrelay command in a pod parses with kvrelay's own argument parser, after
  Kubernetes' ``$(VAR)`` expansion with sample values, and with the container's environment
  (``env`` and ``envFrom``, the downward API given sample values); every ``$(VAR)`` is
  defined in the container's env, and every ``KVRELAY_*`` variable is one kvrelay reads.
- The router runs the autoscaler with the kubernetes hook, and the hook's namespace and
  Deployment names agree with the manifests and with what the autoscaler's Role may patch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay import envs
from kvrelay.cli import parse_args

K8S_DIR = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.30"
NAMESPACE = "kvrelay"
# Sample values for the downward API, as the kubelet would fill them in.
SAMPLE_FIELDS = {"status.podIP": "10.0.0.7", "metadata.name": "kvrelay-decode-5d9c7b-x2x9q"}
SAMPLE_SECRET = "sample-secret"
_VAR = re.compile(r"\$\((\w+)\)")
_SHELL_OPERATORS = {"||", "&&", ";", "|", "&"}


def manifest_files() -> list[Path]:
    """The base's manifests (not its kustomization.yaml; overlays: test_k8s_overlays.py)."""
    return sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")


def load_objects() -> list[tuple[str, dict[str, Any]]]:
    """``(file name, object)`` for every document in ``deploy/k8s/*.yaml``."""
    return [
        (path.name, doc)
        for path in manifest_files()
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


def objects_of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for _, o in load_objects() if o["kind"] == kind}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in ("Deployment", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def containers() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}/{c['name']}", c)
        for _, o in load_objects()
        if (spec := pod_spec(o)) is not None
        for c in spec.get("containers", [])
    ]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``envFrom`` ConfigMaps, then
    ``env`` (literal values, the ConfigMap, the downward API, a sample Secret)."""
    configmaps = {name: o.get("data", {}) for name, o in objects_of_kind("ConfigMap").items()}
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        out.update(configmaps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "value" in item:
            out[item["name"]] = expand(item["value"], out)
        elif "fieldRef" in ref:
            out[item["name"]] = SAMPLE_FIELDS[ref["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            out[item["name"]] = configmaps[key["name"]][key["key"]]
        elif "secretKeyRef" in ref:
            out[item["name"]] = SAMPLE_SECRET
        else:
            pytest.fail(f"env {item['name']}: unexpected source {ref}")
    return out


def expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command and args."""
    return _VAR.sub(lambda m: env[m.group(1)], word)


def kvrelay_words(argv: list[str]) -> list[str] | None:
    """The words after ``kvrelay`` in ``argv``, or in its ``sh -c`` script (None: no kvrelay)."""
    if argv[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
        argv = shlex.split(argv[2])
    if "kvrelay" not in argv:
        return None
    words = argv[argv.index("kvrelay") + 1 :]
    for i, word in enumerate(words):
        if word in _SHELL_OPERATORS:
            return words[:i]
    return words


def test_there_are_manifests() -> None:
    kinds = sorted({o["kind"] for _, o in load_objects()})
    assert kinds == [
        "ConfigMap", "Deployment", "Job", "Namespace", "NetworkPolicy",
        "PersistentVolumeClaim", "Role", "RoleBinding", "Service", "ServiceAccount",
    ]  # fmt: skip
    assert set(objects_of_kind("Deployment")) == {
        "kvrelay-router",
        "kvrelay-prefill",
        "kvrelay-decode",
    }


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(path: Path) -> None:
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    import kubernetes_validate

    for doc in yaml.safe_load_all(path.read_text()):
        if doc is None:
            continue
        where = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.path))}")


def test_every_namespaced_object_is_in_the_kvrelay_namespace() -> None:
    for name, obj in load_objects():
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{name}: {obj['kind']}"


@pytest.mark.parametrize(
    "where,container", containers(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_kvrelay_command_parses(where: str, container: dict[str, Any]) -> None:
    argv = [*container.get("command", []), *container.get("args", [])]
    env = container_env(container)
    used = {m for word in argv for m in _VAR.findall(word)}
    assert used <= env.keys(), f"{where}: $({sorted(used - env.keys())}) not in the env"
    unknown = {k for k in env if k.startswith("KVRELAY_") and k not in envs.BY_NAME}
    assert not unknown, f"{where}: kvrelay does not read {sorted(unknown)}"
    words = kvrelay_words([expand(word, env) for word in argv])
    assert words is not None, f"{where} runs no kvrelay command: {argv}"
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            parse_args(words, environ=env)
    except SystemExit:
        pytest.fail(f"{where}: kvrelay rejects {words}:\n{captured.getvalue()}")


def serve_args(deployment: str) -> Any:
    (container,) = objects_of_kind("Deployment")[deployment]["spec"]["template"]["spec"][
        "containers"
    ]
    env = container_env(container)
    words = kvrelay_words([expand(w, env) for w in container["command"]])
    assert words is not None
    return parse_args(words, environ=env)


def router_container() -> dict[str, Any]:
    (container,) = objects_of_kind("Deployment")["kvrelay-router"]["spec"]["template"]["spec"][
        "containers"
    ]
    return container


def test_workers_reach_the_router_through_its_service() -> None:
    router = serve_args("kvrelay-router")
    assert (router.role, router.control_addr, router.port) == ("router", "tcp://0.0.0.0:5557", 8000)
    assert (router.admin_token, router.host) == (SAMPLE_SECRET, "0.0.0.0")
    (token,) = [e for e in router_container()["env"] if e["name"] == "KVRELAY_ADMIN_TOKEN"]
    assert not token["valueFrom"]["secretKeyRef"].get("optional", False)  # /admin never open
    service = objects_of_kind("Service")["kvrelay-router"]
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 5557}
    for role in ("prefill", "decode"):
        args = serve_args(f"kvrelay-{role}")
        assert args.role == role
        assert args.control_addr == "tcp://kvrelay-router:5557"
        pod_name = SAMPLE_FIELDS["metadata.name"]
        assert (args.advertise_host, args.instance_id) == ("10.0.0.7", pod_name)
        assert args.model == "/models/smollm2"
        assert (args.status_port, args.peer_port) == (8001, 8002)


def test_probes_use_the_status_endpoints() -> None:
    def probes(deployment: str) -> dict[str, tuple[str, Any]]:
        (c,) = objects_of_kind("Deployment")[deployment]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        return {
            kind: (c[kind]["httpGet"]["path"], ports[c[kind]["httpGet"]["port"]])
            for kind in ("livenessProbe", "readinessProbe")
        }

    assert probes("kvrelay-router") == {
        "livenessProbe": ("/health", 8000),
        "readinessProbe": ("/ready", 8000),
    }
    for role in ("kvrelay-prefill", "kvrelay-decode"):
        assert probes(role) == {
            "livenessProbe": ("/health", 8001),
            "readinessProbe": ("/ready", 8001),
        }


def test_router_autoscales_the_worker_deployments_its_role_may_patch() -> None:
    if importlib.util.find_spec("kubernetes") is None:
        pytest.skip("the kubernetes client is not installed (pip install kubernetes)")
    from kvrelay.autoscale.hooks.kubernetes import KubernetesHook

    router = serve_args("kvrelay-router")
    assert router.autoscale == "kubernetes"
    defaults = {name: p.default for name, p in inspect.signature(KubernetesHook).parameters.items()}
    options = {**defaults, **json.loads(router.autoscale_options)}
    deployments = {options["prefill_deployment"], options["decode_deployment"]}
    assert (options["namespace"], options["kubeconfig"]) == (NAMESPACE, None)  # in-cluster
    assert deployments == {"kvrelay-prefill", "kvrelay-decode"}

    router_pod = objects_of_kind("Deployment")["kvrelay-router"]["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == "kvrelay-autoscaler"
    rules = objects_of_kind("Role")["kvrelay-autoscaler"]["rules"]
    scale_rule = next(r for r in rules if r["resources"] == ["deployments/scale"])
    assert (scale_rule["apiGroups"], set(scale_rule["verbs"])) == (["apps"], {"get", "patch"})
    assert set(scale_rule["resourceNames"]) == deployments
    pod_rule = next(r for r in rules if r["resources"] == ["pods"])  # pod-deletion-cost
    assert (pod_rule["apiGroups"], pod_rule["verbs"]) == ([""], ["patch"])
    binding = objects_of_kind("RoleBinding")["kvrelay-autoscaler"]
    assert binding["roleRef"]["name"] == "kvrelay-autoscaler"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvrelay-autoscaler", "namespace": NAMESPACE}
    ]


@pytest.mark.parametrize("deployment", ["kvrelay-prefill", "kvrelay-decode"])
def test_workers_mount_memory_shm_and_the_models_read_only(deployment: str) -> None:
    pod = objects_of_kind("Deployment")[deployment]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    models = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]
    assert (models["claimName"], models["readOnly"], mounts["/models"]["readOnly"]) == (
        "kvrelay-models",
        True,
        True,
    )
    assert set(objects_of_kind("PersistentVolumeClaim")) == {"kvrelay-models"}
    assert pod["automountServiceAccountToken"] is False


def test_workers_keep_their_kv_hand_off_and_weights_pod_local() -> None:
    for role in ("prefill", "decode"):
        args = serve_args(f"kvrelay-{role}")
        assert args.host_id == SAMPLE_FIELDS["metadata.name"]  # one /dev/shm per pod
        assert args.transport == "tcp"
        assert args.no_param_pool is True


CLUSTER_PORTS = {5557: "router", 8001: "worker", 8002: "worker"}  # control, status, peer


def test_every_serving_pod_requires_the_cluster_secret_and_none_is_committed() -> None:
    assert "Secret" not in {o["kind"] for _, o in load_objects()}  # the operator makes it
    for name, deployment in objects_of_kind("Deployment").items():
        for container in pod_spec(deployment)["containers"]:  # type: ignore[index]
            env = {item["name"]: item for item in container.get("env", [])}
            ref = env["KVRELAY_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "kvrelay-cluster-secret", "key": "secret", "optional": False}
            assert "KVRELAY_INSECURE_NO_AUTH" not in container_env(container), name


def _admits(rule: dict[str, Any], port: int) -> bool:
    return any(p["port"] == port for p in rule.get("ports", [])) or "ports" not in rule


def test_only_kvrelay_pods_reach_the_control_peer_and_status_ports() -> None:
    policies = objects_of_kind("NetworkPolicy").values()
    component = {"router": ["router"], "worker": ["prefill", "decode"]}
    for port, kind in CLUSTER_PORTS.items():
        for role in component[kind]:
            selecting = [p for p in policies if _selects(p["spec"]["podSelector"], role)]
            assert selecting, f"no NetworkPolicy selects the {role} pods"
            rules = [r for p in selecting for r in p["spec"].get("ingress", []) if _admits(r, port)]
            assert rules, f"port {port} of {role}: not admitted at all"
            for rule in rules:  # every rule that admits the port admits kvrelay pods only
                sources = rule.get("from")
                assert sources, f"port {port} of {role} is open to everyone"
                for source in sources:
                    labels = source["podSelector"]["matchLabels"]
                    assert labels == {"app.kubernetes.io/name": "kvrelay"}, source
                    assert "namespaceSelector" not in source and "ipBlock" not in source


def _selects(selector: dict[str, Any], component: str) -> bool:
    labels = {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/component": component}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True
