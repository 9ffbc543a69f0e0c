"""A request body to a validated request model: JSON parsing with the API's 400s.

``parse_request`` is what every JSON route runs first: an empty body, invalid UTF-8 or JSON,
a non-object, NaN / Infinity, lone UTF-16 surrogates, an unknown or unsupported field
(``request_models.check_fields``) and a field of the wrong type each get a 400 naming what
is wrong, before a handler sees the request.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kvrelay.router.errors import bad_request, from_pydantic
from kvrelay.router.request_models import check_fields

RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(body: bytes, model: type[RequestT]) -> RequestT:
    """A validated request model from a raw body.

    Raises:
        ApiError: 400 for an empty body, invalid UTF-8 or JSON, a non-object, lone
            surrogates in strings, or a field of the wrong type.
    """
    data = parse_json_object(body)
    check_fields(data, model)
    return validate_request(data, model)


def validate_request(data: dict[str, Any], model: type[RequestT]) -> RequestT:
    """``model`` from a parsed body; 400 naming the field for a wrong type or value."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise bad_request("The request body is empty; expected a JSON object")
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply") from None
    except ValueError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}")
    _reject_lone_surrogates(data)
    return data


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _reject_lone_surrogates(data: object) -> None:
    """Strings from ``\\ud800``-style escapes cannot be tokenized or sent back as UTF-8."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("The request holds an unpaired UTF-16 surrogate") from None
