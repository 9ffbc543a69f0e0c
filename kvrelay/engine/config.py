"""Frozen, validated configuration for the model, the KV cache and the scheduler.

Every field has a default and a one-line comment; ``__post_init__`` raises ``ValueError``
naming the valid choices. Derived values are made with ``dataclasses.replace``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kvrelay.protocol.pooling import ClassifierConfig, PoolerConfig
from kvrelay.protocol.speculative import SpeculativeConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# the same decoders without an LM head: embedding checkpoints (e5-mistral, gte-Qwen2), served
# through /v1/embeddings only
EMBEDDING_ARCHITECTURES = ("LlamaModel", "Qwen2Model", "MistralModel")
# with a ``score`` head instead: reward models, classifiers, cross-encoder rerankers, served
# through /classify, /score and /rerank
CLASSIFIER_ARCHITECTURES = (
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "MistralForSequenceClassification",
)
_ARCHITECTURES = SUPPORTED_ARCHITECTURES + EMBEDDING_ARCHITECTURES + CLASSIFIER_ARCHITECTURES
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DType = Literal["float32", "bfloat16", "float16"]
DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


class ConfigError(ValueError):
    """A checkpoint's config.json or a user setting that kvrelay cannot use."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0  # base of the rotary frequencies
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0  # linear / llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope_type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        """Reads transformers 5 ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return cls(
            theta=float(theta),
            rope_type=str(rope_type),
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str = "LlamaForCausalLM"  # HF architecture name
    vocab_size: int = 32000  # rows of the embedding table
    hidden_size: int = 4096  # model width
    intermediate_size: int = 11008  # MLP width
    num_layers: int = 32  # decoder layers
    num_heads: int = 32  # query heads
    num_kv_heads: int = 32  # key/value heads (GQA when fewer than num_heads)
    head_dim: int = 128  # per-head width
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope: RopeConfig = field(default_factory=RopeConfig)  # rotary embedding settings
    max_position_embeddings: int = 4096  # context window
    tie_word_embeddings: bool = False  # lm_head shares the embedding weight
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    sliding_window: int | None = None  # attend only to the last N keys (Mistral v0.1)
    bos_token_id: int | None = None  # from config.json
    eos_token_ids: tuple[int, ...] = ()  # from config.json / generation_config.json
    classifier: ClassifierConfig | None = None  # a *ForSequenceClassification's score head

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(_ARCHITECTURES)}"
            )
        if (self.architecture in CLASSIFIER_ARCHITECTURES) != (self.classifier is not None):
            raise ConfigError(f"{self.architecture}: a classifier head needs its architecture")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")
        if not arch:
            raise ConfigError("config.json names no architecture (architectures / model_type)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        sliding = cfg.get("sliding_window")
        qwen2 = arch.startswith("Qwen2")
        if qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", qwen2)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
            classifier=ClassifierConfig.from_hf(cfg) if arch in CLASSIFIER_ARCHITECTURES else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Reads ``config.json`` and merges eos ids from ``generation_config.json``."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(f"missing file: {path}")
        cfg = json.loads(path.read_text())
        config = cls.from_hf(cfg)
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen_eos = _as_id_tuple(json.loads(gen_path.read_text()).get("eos_token_id"))
            merged = tuple(dict.fromkeys(config.eos_token_ids + gen_eos))
            config = replace(config, eos_token_ids=merged)
        return config

    @property
    def generates(self) -> bool:
        """Whether it has an LM head (a ``*ForCausalLM``); an embedding checkpoint does not."""
        return self.architecture in SUPPORTED_ARCHITECTURES

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, per element byte."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks in the pool; None = from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30  # memory for the pool when num_blocks is None
    enable_prefix_caching: bool = True  # reuse full blocks by chained hash

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens computed per step (chunked-prefill budget)
    max_model_len: int = 4096  # longest prompt + output
    # fcfs: arrival order; priority: SamplingParams.priority, then arrival (vLLM's policies)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES},"
                f" got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = ""  # checkpoint directory
    dtype: DType = "float32"  # weights, activations and KV cache
    seed: int = 0  # seed for requests without their own
    num_threads: int | None = None  # torch intra-op threads; None = leave as is
    device: str = "cpu"  # where weights, KV pool and compute live: cpu, cuda or cuda:N
    model_config: ModelConfig = field(default_factory=ModelConfig)  # parsed config.json
    cache: CacheConfig = field(default_factory=CacheConfig)  # KV cache settings
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # batching limits
    # LoRA adapters to load, (name, PEFT adapter directory); requests pick one by name
    lora_modules: tuple[tuple[str, str], ...] = ()
    # speculative decoding (engine.spec_decode); None: one token a decode step
    speculative_config: SpeculativeConfig | None = None
    # how embedding requests pool (protocol.pooling); None: the checkpoint's sentence-
    # transformers modules.json, else the last token's state, normalized
    pooler_config: PoolerConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not _DEVICE_RE.fullmatch(self.device):
            raise ConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
