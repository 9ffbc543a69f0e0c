"""Embeddings' settings, without torch: how a model pools a prompt's hidden states into one
vector (``PoolerConfig``, vLLM's ``--pooler-config`` keys) and what one request asks of it
(``PoolingParams``, carried by ``GenerateRequest.pooling``).

A pooled request computes its prompt and nothing else: no token is sampled, no KV is handed
to a decode worker. The engine takes the final norm's output at the prompt's last token
(``LAST``, for decoder models such as e5-mistral or gte-Qwen2), its first (``CLS``) or the
mean over every prompt token (``MEAN``), then optionally truncates it to ``dimensions``
(Matryoshka embeddings) and scales it to unit L2 norm.

A sequence classifier (``*ForSequenceClassification``: reward models, cross-encoder
rerankers) pools the same way, then its ``score`` head maps the state to one logit per
label (``ClassifierConfig``); the activation, when asked, is a softmax over the labels, or a
sigmoid when there is one label or the labels are independent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvrelay.protocol.json_flag import json_object

POOLING_TYPES = ("LAST", "MEAN", "CLS")
CLASSIFIER_SUFFIX = "ForSequenceClassification"
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
class ClassifierConfig:
    """A sequence classifier's head, from its config.json (torch-free: the router reads it
    to answer ``/classify``, ``/score`` and ``/rerank``)."""

    labels: tuple[str, ...]  # id2label, by id: one logit each
    # softmax | sigmoid (one label, or independent labels) | identity (a regression head)
    activation: str = "softmax"
    # a pair (``/score``'s query and document) is joined by the tokenizer's pair template
    # (its separators), as transformers' ``tokenizer(text, text_pair)``; false: the texts
    # are concatenated and tokenized as one (config.json ``use_sep_token``, as in vLLM)
    pair_separator: bool = True

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def scores_pairs(self) -> bool:
        """Whether it is a cross-encoder: one label, read as a pair's relevance."""
        return self.num_labels == 1

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ClassifierConfig | None:
        """The head a config.json declares; None when its architecture is no classifier."""
        archs = cfg.get("architectures") or []
        if not (archs and str(archs[0]).endswith(CLASSIFIER_SUFFIX)):
            return None
        id2label = cfg.get("id2label")
        if isinstance(id2label, Mapping) and id2label:
            try:
                by_id = {int(k): str(v) for k, v in id2label.items()}
            except (TypeError, ValueError):
                raise PoolingConfigError("config.json id2label keys must be integers") from None
            if sorted(by_id) != list(range(len(by_id))):
                raise PoolingConfigError("config.json id2label must number its labels 0..N-1")
            labels = tuple(by_id[i] for i in range(len(by_id)))
        else:
            num = cfg.get("num_labels", 2)
            if isinstance(num, bool) or not isinstance(num, int) or num < 1:
                raise PoolingConfigError(f"config.json num_labels must be >= 1, got {num!r}")
            labels = tuple(f"LABEL_{i}" for i in range(num))
        return cls(labels, _activation(cfg, len(labels)), bool(cfg.get("use_sep_token", True)))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ClassifierConfig | None:
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise PoolingConfigError(f"{path}: {e}") from None


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


_ST_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Softmax": "softmax"}


def _activation(cfg: Mapping[str, Any], num_labels: int) -> str:
    """A classifier's activation, as transformers' loss for its ``problem_type`` implies,
    else as sentence-transformers' cross-encoder config names it, else softmax (sigmoid for
    one label)."""
    problem = cfg.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    st = cfg.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, Mapping) else None
    name = name or cfg.get("sbert_ce_default_activation_function")
    if problem != "single_label_classification" and isinstance(name, str):
        short = name.rsplit(".", 1)[-1]
        if not name.startswith("torch.nn.modules.") or short not in _ST_ACTIVATIONS:
            raise PoolingConfigError(
                f"config.json names the activation {name!r}; kvrelay follows"
                f" {', '.join(f'torch.nn.{n}' for n in _ST_ACTIVATIONS)}"
            )
        if short != "Softmax":
            return _ST_ACTIVATIONS[short]
    return "sigmoid" if num_labels == 1 else "softmax"
