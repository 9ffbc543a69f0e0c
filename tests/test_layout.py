"""The layout is the architecture: these import rules are what DESIGN.md's Layout section says.

- the router, ``protocol/`` and ``text/`` load no torch (and ``protocol/`` no numpy);
- ``protocol/`` and ``text/`` import nothing from engine, worker, router, prefill or decode;
- the router imports nothing from engine, worker, prefill or decode;
- prefill and decode never import each other;
- every ``from kvrelay.X import name`` takes ``name`` from the module that defines it (no
  module re-exports another's names), except the package's public ``LLM``,
  ``SamplingParams``, ``PoolingParams`` and ``LoRARequest``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvrelay"
SOURCES = sorted(
    [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
)

FORBIDDEN = {
    "protocol": ("engine", "worker", "router", "prefill", "decode", "transport", "cachetier"),
    "text": ("engine", "worker", "router", "prefill", "decode", "protocol.messages"),
    "router": ("engine", "worker", "prefill", "decode", "kernels"),
    "prefill": ("decode",),
    "decode": ("prefill",),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _kvrelay_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``import kvrelay...`` / ``from kvrelay... import``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvrelay"):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("kvrelay")]
    return found


def _defined_names(module: str) -> set[str] | None:
    """Top-level names ``module`` defines itself (None: it is a package directory)."""
    path = ROOT / Path(*module.split("."))
    if path.is_dir():
        path = path / "__init__.py"
    else:
        path = path.with_suffix(".py")
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, fallbacks
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
    return names


@pytest.mark.parametrize("component", sorted(FORBIDDEN))
def test_components_import_only_what_the_design_allows(component: str) -> None:
    broken = []
    for path in sorted((PACKAGE / component).rglob("*.py")):
        for line, module, _ in _kvrelay_imports(path):
            for other in FORBIDDEN[component]:
                if module == f"kvrelay.{other}" or module.startswith(f"kvrelay.{other}."):
                    broken.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not broken, "\n".join(broken)


def test_every_name_is_imported_from_where_it_is_defined() -> None:
    public = {
        ("kvrelay", name) for name in ("LLM", "SamplingParams", "PoolingParams", "LoRARequest")
    }
    broken = []
    for path in SOURCES:
        for line, module, names in _kvrelay_imports(path):
            defined = _defined_names(module)
            for name in names:
                if (module, name) in public or name in defined:
                    continue
                submodule = ROOT / Path(*module.split("."), name)
                if submodule.with_suffix(".py").exists() or submodule.is_dir():
                    continue  # ``from kvrelay.pkg import module``
                broken.append(f"{path.relative_to(ROOT)}:{line} takes {name} from {module}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("modules", "banned"),
    [
        (["kvrelay.router.server"], ["torch"]),
        (["kvrelay.protocol.messages", "kvrelay.protocol.errors"], ["torch", "numpy"]),
        (["kvrelay.text.tokenizer", "kvrelay.text.stop"], ["torch"]),
        # Triton loads on a GPU's first launch: ~0.4 s of every CPU worker's start otherwise
        (["kvrelay.prefill.worker", "kvrelay.decode.worker"], ["triton"]),
    ],
)
def test_light_components_load_no_torch(modules: list[str], banned: list[str]) -> None:
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print([b for b in {banned!r} if b in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.stdout.strip() == "[]", f"{modules} loaded {out.stdout.strip()}"
