"""A command-line flag that takes a JSON object (``--speculative-config``, ``--pooler-config``),
read without torch so that ``kvrelay up`` and the router check it before anything starts."""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str, flag: str, error: type[ValueError]) -> dict[str, Any]:
    """``text`` as a JSON object; ``error`` naming ``flag`` when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{flag} must be a JSON object")
    return value
