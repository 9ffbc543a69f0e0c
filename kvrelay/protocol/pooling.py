"""Embeddings' settings, without torch: how a model pools a prompt's hidden states into one
vector (``PoolerConfig``, vLLM's ``--pooler-config`` keys) and what one request asks of it
(``PoolingParams``, carried by ``GenerateRequest.pooling``).

A pooled request computes its prompt and nothing else: no token is sampled, no KV is handed
to a decode worker. The engine takes the final norm's output at the prompt's last token
(``LAST``, for decoder models such as e5-mistral or gte-Qwen2), its first (``CLS``) or the
mean over every prompt token (``MEAN``), then optionally truncates it to ``dimensions``
(Matryoshka embeddings) and scales it to unit L2 norm.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvrelay.protocol.json_flag import json_object

POOLING_TYPES = ("LAST", "MEAN", "CLS")
MAX_DIMENSIONS = 1 << 16


class PoolingConfigError(ValueError):
    """A pooler config or pooling request kvrelay cannot use (the message names the key)."""


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the model's hidden states become an embedding (vLLM's ``pooler_config``)."""

    pooling_type: str = "LAST"  # LAST | MEAN | CLS
    normalize: bool = True  # unit L2 norm unless a request says otherwise

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise PoolingConfigError(
                f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)},"
                f" got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise PoolingConfigError(
                f"pooler_config normalize must be true or false, got {self.normalize!r}"
            )

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's state is pooled (no prefix-cache hit may skip one)."""
        return self.pooling_type != "LAST"

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> PoolerConfig:
        known = {f.name for f in fields(cls)} | {"use_activation"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise PoolingConfigError(
                f"pooler_config: unsupported key(s) {', '.join(map(repr, unknown))}"
                f" (kvrelay takes {', '.join(sorted(known))})"
            )
        args = dict(value)
        if "use_activation" in args:  # vLLM 0.32's name of normalize
            args["normalize"] = args.pop("use_activation")
        if isinstance(args.get("pooling_type"), str):
            args["pooling_type"] = args["pooling_type"].upper()
        return cls(**args)

    @classmethod
    def parse(cls, text: str) -> PoolerConfig:
        """From the command line's JSON (``--pooler-config``)."""
        return cls.from_dict(json_object(text, "--pooler-config", PoolingConfigError))

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PoolerConfig | None:
        """The pooling a sentence-transformers checkpoint declares (``modules.json``: a
        ``Pooling`` module's ``config.json`` and whether a ``Normalize`` module follows);
        None when the directory declares none."""
        root = Path(model_dir)
        try:
            modules = json.loads((root / "modules.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as e:
            raise PoolingConfigError(f"{root / 'modules.json'}: {e}") from None
        if not isinstance(modules, list):
            raise PoolingConfigError(f"{root / 'modules.json'}: expected a list of modules")
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
        if "Pooling" not in kinds:
            return None
        pooling = modules[kinds.index("Pooling")]
        path = root / str(pooling.get("path", "")) / "config.json"
        try:
            st = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PoolingConfigError(f"{path}: {e}") from None
        modes = {
            "pooling_mode_lasttoken": "LAST",
            "pooling_mode_mean_tokens": "MEAN",
            "pooling_mode_cls_token": "CLS",
        }
        chosen = sorted(k for k, v in st.items() if k.startswith("pooling_mode_") and v)
        if len(chosen) != 1 or chosen[0] not in modes:
            raise PoolingConfigError(
                f"{path}: kvrelay pools with exactly one of {', '.join(modes)};"
                f" this checkpoint sets {', '.join(chosen) or 'none'}"
            )
        return cls(modes[chosen[0]], "Normalize" in kinds)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One embedding request's options (vLLM's ``PoolingParams``)."""

    dimensions: int | None = None  # keep the first N values (before normalizing); None: all
    # scale to unit L2 norm (vLLM 0.32's name; its older ``normalize``); None: the model's
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIMENSIONS
        ):
            raise PoolingConfigError(f"'dimensions' must be an integer >= 1, got {d!r}")
        flag = self.use_activation
        if flag is not None and not isinstance(flag, bool):
            raise PoolingConfigError(f"'use_activation' must be true or false, got {flag!r}")
