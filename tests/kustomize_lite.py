"""The part of ``kustomize build`` that kvrelay's overlays use, for CI without the binary.

Supported, and nothing else (``build`` raises on any other kustomization field, so an overlay
cannot use a feature this renderer would get wrong): ``resources`` (files, or directories with
a kustomization.yaml), ``patches`` (``path:`` of one strategic-merge patch each, targeted by
kind, name and namespace; ``$patch: delete`` removes the object) and ``images`` (``name``
with ``newName`` / ``newTag``). Strategic merge as Kubernetes does it for the fields patched
here: mappings merge key by key, lists of objects with a ``name`` merge by name (containers,
env, volumes, volumeMounts), every other list is replaced.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images"}
Obj = dict[str, Any]


def build(directory: Path) -> list[Obj]:
    """The objects ``kustomize build directory`` prints, in resource order."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}: kustomization fields {sorted(unknown)} not supported")
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(build(path))
        else:
            objects.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only `path:` patches are supported, got {patch}")
        objects = _apply_patch(objects, yaml.safe_load((directory / patch["path"]).read_text()))
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _key(obj: Obj) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta["name"], meta.get("namespace", "")


def _apply_patch(objects: list[Obj], patch: Obj) -> list[Obj]:
    patch = dict(patch)
    is_delete = patch.pop("$patch", None) == "delete"
    matches = [i for i, obj in enumerate(objects) if _key(obj) == _key(patch)]
    if len(matches) != 1:
        raise ValueError(f"patch target {_key(patch)} matches {len(matches)} objects")
    (i,) = matches
    if is_delete:
        return objects[:i] + objects[i + 1 :]
    out = list(objects)
    out[i] = merge(objects[i], patch)
    return out


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge of ``patch`` into ``base`` (neither is changed)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _is_named(base + patch):
        out = copy.deepcopy(base)
        names = [item["name"] for item in out]
        for item in patch:
            if item["name"] in names:
                at = names.index(item["name"])
                out[at] = merge(out[at], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _is_named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def _set_image(obj: Obj, image: Obj) -> None:
    spec = obj.get("spec", {}).get("template", {}).get("spec")
    if spec is None:
        return
    for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            new_name = image.get("newName", name)
            container["image"] = f"{new_name}:{image.get('newTag', tag)}"
