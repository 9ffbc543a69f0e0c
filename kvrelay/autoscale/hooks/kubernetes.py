"""The ``kubernetes`` hook: scales the prefill and decode Deployments.

Per decision, for each role: read the Deployment's scale subresource
(``GET /apis/apps/v1/namespaces/<ns>/deployments/<name>/scale``) and, only when its
``spec.replicas`` differs from the decision's count, ``PATCH`` that subresource with
``{"spec": {"replicas": n}}`` (the official client sends it as
``application/strategic-merge-patch+json``). A role whose Deployment already asks for the
wanted count gets no write, so a repeated decision changes nothing and leaves no audit
entries. The comparison is with the Deployment's desired count, not with the instances the
router has counted (``decision.current_*``): pods still starting are already asked for.

On a scale-down the platform, not the autoscaler, picks which pods the ReplicaSet deletes;
it deletes the pods with the lowest ``controller.kubernetes.io/pod-deletion-cost`` first. So
before lowering any Deployment's replicas the hook ``PATCH``es every pod named in
``decision.drain`` (the instances the autoscaler drained; a pod's instance id is its name,
``deploy/``) with the lowest cost, so those pods, and not busy ones, are the ones deleted. A
drained instance that is no pod of this namespace (404) is logged and skipped: the scale-down
still happens, with the platform's choice.

Credentials: ``kubeconfig`` (a path) when given; otherwise the pod's service account when
running in a cluster (``KUBERNETES_SERVICE_HOST`` is set); otherwise the default kubeconfig
(``~/.kube/config`` or ``$KUBECONFIG``). They load into this hook's own client
configuration, never the process-wide default. RBAC needed: ``get`` and ``patch`` on
``deployments/scale`` and ``patch`` on ``pods`` in the namespace (``deploy/k8s/rbac.yaml``,
the Helm chart's Role).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from kvrelay.autoscale.base import HookError, ScaleDecision, ScalingHook

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = str(-(2**31))  # the annotation is an int32; lower goes first


class KubernetesHook(ScalingHook):
    name = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str = "kvrelay",
        prefill_deployment: str = "kvrelay-prefill",
        decode_deployment: str = "kvrelay-decode",
        kubeconfig: str | None = None,
        context: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        """
        Args:
            namespace: the namespace of both Deployments.
            prefill_deployment, decode_deployment: the Deployments that run each role.
            kubeconfig: path of a kubeconfig file (default: in-cluster service account, else
                the default kubeconfig).
            context: kubeconfig context (default: its current-context).
            timeout: seconds for one ``apply`` (at most two reads and two patches).

        Raises:
            ValueError: a bad option, or credentials that cannot be loaded.
        """
        if not namespace or not prefill_deployment or not decode_deployment:
            raise ValueError("kubernetes hook needs a namespace and both deployment names")
        if prefill_deployment == decode_deployment:
            raise ValueError(f"prefill and decode deployments are both {prefill_deployment!r}")
        if timeout <= 0:
            raise ValueError(f"kubernetes hook timeout must be > 0, got {timeout}")
        self.namespace = namespace
        self.deployments = {"prefill": prefill_deployment, "decode": decode_deployment}
        self.timeout = timeout
        self._api_client = client.ApiClient(_load_configuration(kubeconfig, context))
        self._apps = client.AppsV1Api(self._api_client)
        self._core = client.CoreV1Api(self._api_client)

    def apply(self, decision: ScaleDecision) -> None:
        deadline = time.monotonic() + self.timeout
        wanted = {"prefill": decision.prefill, "decode": decision.decode}
        current = {
            role: self._read_replicas(name, deadline) for role, name in self.deployments.items()
        }
        if any(wanted[role] < current[role] for role in wanted):
            for pod in decision.drain:
                self._mark_for_deletion(pod, deadline)
        for role, name in self.deployments.items():
            if current[role] == wanted[role]:
                logger.debug("kubernetes hook: %s already at %d", name, wanted[role])
                continue
            self._patch_replicas(name, wanted[role], deadline)
            logger.info(
                "kubernetes hook: %s/%s %d -> %d", self.namespace, name, current[role], wanted[role]
            )

    def close(self) -> None:
        self._api_client.close()

    def _read_replicas(self, name: str, deadline: float) -> int:
        try:
            scale = self._apps.read_namespaced_deployment_scale(
                name, self.namespace, _request_timeout=_left(deadline, name)
            )
        except (ApiException, urllib3.exceptions.HTTPError, ValueError) as e:
            raise HookError(f"kubernetes: GET {self._where(name)}: {_describe(e)}") from e
        return int(scale.spec.replicas or 0) if scale.spec else 0

    def _patch_replicas(self, name: str, replicas: int, deadline: float) -> None:
        try:
            self._apps.patch_namespaced_deployment_scale(
                name,
                self.namespace,
                body={"spec": {"replicas": replicas}},
                _request_timeout=_left(deadline, name),
            )
        except (ApiException, urllib3.exceptions.HTTPError, ValueError) as e:
            raise HookError(f"kubernetes: PATCH {self._where(name)}: {_describe(e)}") from e

    def _mark_for_deletion(self, pod: str, deadline: float) -> None:
        """Gives drained pod ``pod`` the lowest deletion cost; a missing pod is skipped."""
        body = {"metadata": {"annotations": {DELETION_COST: LOWEST_COST}}}
        try:
            self._core.patch_namespaced_pod(
                pod, self.namespace, body=body, _request_timeout=_left(deadline, pod)
            )
        except ApiException as e:
            if e.status != 404:
                where = f"pods/{pod} in namespace {self.namespace}"
                raise HookError(f"kubernetes: PATCH {where}: {_describe(e)}") from e
            logger.warning("kubernetes hook: drained instance %s is no pod here; skipped", pod)
            return
        except (urllib3.exceptions.HTTPError, ValueError) as e:
            raise HookError(f"kubernetes: PATCH pods/{pod}: {_describe(e)}") from e
        logger.info("kubernetes hook: pod %s/%s goes first on the scale-down", self.namespace, pod)

    def _where(self, name: str) -> str:
        return f"deployments/{name}/scale in namespace {self.namespace}"


def _load_configuration(kubeconfig: str | None, context: str | None) -> client.Configuration:
    cfg = client.Configuration()
    try:
        if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(
                config_file=kubeconfig,
                context=context,
                client_configuration=cfg,
                persist_config=False,
            )
    except (ConfigException, OSError) as e:
        where = kubeconfig or "in-cluster service account / default kubeconfig"
        raise ValueError(f"kubernetes hook: cannot load credentials from {where}: {e}") from e
    return cfg


def _left(deadline: float, name: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HookError(f"kubernetes: out of time before the request for {name}")
    return left


def _describe(error: Exception) -> str:
    """``403 Forbidden: <the API server's message>`` for an API error; else the error."""
    if not isinstance(error, ApiException):
        return f"{type(error).__name__}: {error}"
    message = error.body or ""
    with contextlib.suppress(ValueError, AttributeError):  # not a JSON Status object
        message = json.loads(message).get("message", message)
    return f"{error.status} {error.reason}: {message}"
