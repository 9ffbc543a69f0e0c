"""LoRA adapter names and ``--lora-modules NAME=PATH`` items, without torch (the router's
command line and its request checks use them; ``engine.lora`` loads the adapters)."""

from __future__ import annotations

from collections.abc import Iterable

MAX_NAME_LEN = 256  # characters of an adapter name (it is also a model name clients send)


def check_name(name: str) -> None:
    """ValueError unless ``name`` can name an adapter: 1-256 characters, no spaces around."""
    if not (0 < len(name) <= MAX_NAME_LEN) or name != name.strip():
        raise ValueError(
            f"a LoRA adapter name must be 1-{MAX_NAME_LEN} characters without surrounding "
            f"spaces, got {name!r}"
        )


def parse_lora_modules(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH`` items (``--lora-modules``) as ``(name, path)`` pairs; ValueError naming a
    malformed or repeated one."""
    pairs: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH items, got {spec!r}")
        check_name(name)
        if name in pairs:
            raise ValueError(f"--lora-modules names {name!r} twice")
        pairs[name] = path
    return tuple(pairs.items())
