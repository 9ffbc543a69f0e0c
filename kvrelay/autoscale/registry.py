"""The one lazy registry of scaling hooks.

A hook's module is imported only when the hook is created, so choosing ``local`` or
``webhook`` never imports the ``kubernetes`` client, and importing this module imports no
hook at all.

=============  ===========================================  =============================
name           what ``apply`` does                          options (keyword arguments)
=============  ===========================================  =============================
``local``      starts / stops worker processes on this host  see ``hooks/local.py``
``compose``    ``docker compose up -d --scale ...``          file, project, prefill_service,
                                                             decode_service, command, timeout
``kubernetes`` PATCHes the Deployments' scale subresource    namespace, prefill_deployment,
                                                             decode_deployment, kubeconfig,
                                                             context, timeout
``webhook``    POSTs the decision as JSON                    url, token, timeout, attempts,
                                                             backoff
``exec``       runs a command with the decision in its env   command, timeout, cwd
=============  ===========================================  =============================
"""

from __future__ import annotations

import importlib
from typing import Any

from kvrelay.autoscale.base import ScalingHook

_REGISTRY: dict[str, tuple[str, str]] = {
    "local": ("kvrelay.autoscale.hooks.local", "LocalHook"),
    "compose": ("kvrelay.autoscale.hooks.compose", "ComposeHook"),
    "kubernetes": ("kvrelay.autoscale.hooks.kubernetes", "KubernetesHook"),
    "webhook": ("kvrelay.autoscale.hooks.webhook", "WebhookHook"),
    "exec": ("kvrelay.autoscale.hooks.exec", "ExecHook"),
}
HOOK_NAMES: tuple[str, ...] = tuple(_REGISTRY)
_EXTRAS = {"kubernetes": "kvrelay[k8s]"}  # what installs a hook's optional dependencies


def create_hook(name: str, **options: Any) -> ScalingHook:
    """A new hook by name; ``options`` go to its constructor.

    Raises:
        ValueError: ``name`` is not one of ``HOOK_NAMES``, or an option value is invalid.
        ImportError: the hook's optional dependency is not installed (the message says
            which, and the extra that installs it).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown scaling hook {name!r}; choose one of {', '.join(HOOK_NAMES)}")
    module_name, class_name = _REGISTRY[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "kvrelay":
            raise
        hint = f" (pip install '{_EXTRAS[name]}')" if name in _EXTRAS else ""
        raise ImportError(f"the {name} scaling hook needs {e.name!r}{hint}") from e
    cls = getattr(module, class_name)
    hook = cls(**options)
    assert isinstance(hook, ScalingHook), f"{module_name}.{class_name} is not a ScalingHook"
    return hook
