"""Speculative decoding's settings (vLLM's ``speculative_config`` keys), without torch: the
router's and ``kvrelay up``'s command lines check ``--speculative-config`` before any worker
starts; ``engine.spec_decode`` drafts and verifies."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvrelay.protocol.json_flag import json_object


class SpeculativeConfigError(ValueError):
    """A speculative_config that kvrelay cannot use (the message names the key)."""


SPEC_METHODS = ("ngram",)
DEFAULT_LOOKUP = (2, 4)  # prompt_lookup_min, prompt_lookup_max
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for its ``ngram`` method (the same keys)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # draft tokens a step, at most
    prompt_lookup_max: int = DEFAULT_LOOKUP[1]  # longest suffix matched
    prompt_lookup_min: int = DEFAULT_LOOKUP[0]  # shortest suffix matched
    # no drafts in a step once this many sequences run (None: always draft)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise SpeculativeConfigError(
                f"speculative_config method {self.method!r} is not supported"
                f" (kvrelay drafts with {', '.join(SPEC_METHODS)})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"speculative_config num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS},"
                f" got {k!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise SpeculativeConfigError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max,"
                f" got {low!r} and {high!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise SpeculativeConfigError(
                f"speculative_config disable_by_batch_size must be >= 1, got {limit!r}"
            )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict (``LLM(speculative_config=...)``); unknown keys are refused. As
        in vLLM, one of the two lookup bounds given sets the other."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unsupported key(s) {', '.join(map(repr, unknown))}"
                f" (kvrelay takes {', '.join(sorted(known))})"
            )
        if "method" not in value:
            raise SpeculativeConfigError("speculative_config needs a method (kvrelay: 'ngram')")
        args = dict(value)
        low, high = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
        if low is None and high is not None:
            args["prompt_lookup_min"] = min(high, DEFAULT_LOOKUP[0])
        if high is None and low is not None:
            args["prompt_lookup_max"] = max(low, DEFAULT_LOOKUP[1])
        return cls(**args)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the command line's JSON (``--speculative-config``)."""
        return cls.from_dict(json_object(text, "--speculative-config", SpeculativeConfigError))

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
