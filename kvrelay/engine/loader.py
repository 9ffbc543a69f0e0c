"""Hugging Face checkpoint directory -> runtime tensors for ``LlamaModel``.

Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``, maps
HF tensor names to the runtime names of ``models/llama.py`` (q/k/v and gate/up fused),
and casts to the engine dtype. What it does to the tensors is part of the model identity
(``identity.CONVERSION``): change ``prepare_weights``, bump it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvrelay.engine.config import EMBEDDING_ARCHITECTURES, ConfigError, ModelConfig
from kvrelay.engine.identity import CheckpointError, weight_files

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def iter_hf_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def load_weights(
    model_dir: str | Path, config: ModelConfig, dtype: str = "float32"
) -> dict[str, torch.Tensor]:
    """Loads a checkpoint from disk as runtime tensors (see ``models/llama.py``)."""
    hf = {
        name: t
        for name, t in iter_hf_tensors(model_dir)
        if not name.endswith("rotary_emb.inv_freq")
    }
    return prepare_weights(config, hf, dtype)


def prepare_weights(
    config: ModelConfig, hf: dict[str, torch.Tensor], dtype: str = "float32"
) -> dict[str, torch.Tensor]:
    """Maps HF names to runtime names, fusing q/k/v and gate/up; consumes ``hf``.

    Projection weights come out transposed to ``[in, out]`` (see ``models/llama.py``).
    """
    torch_dtype = TORCH_DTYPES[dtype]
    if config.architecture in EMBEDDING_ARCHITECTURES and "embed_tokens.weight" in hf:
        # an embedding checkpoint saved from the bare decoder (LlamaModel): no ``model.``
        hf = {f"model.{name}": hf.pop(name) for name in list(hf)}

    def take(name: str) -> torch.Tensor:
        try:
            return hf.pop(name).to(torch_dtype)
        except KeyError:
            raise CheckpointError(f"checkpoint has no tensor {name!r}") from None

    out = {"embed": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if "lm_head.weight" in hf and not config.tie_word_embeddings and config.generates:
        out["lm_head"] = take("lm_head.weight").t()
    elif not config.tie_word_embeddings and config.generates:
        raise CheckpointError(
            "checkpoint has no tensor 'lm_head.weight' and embeddings are not tied"
        )
    hf.pop("lm_head.weight", None)
    if config.classifier is not None:  # [labels, hidden], as nn.Linear keeps it
        out["score"] = take("score.weight")
        want = (config.classifier.num_labels, config.hidden_size)
        if tuple(out["score"].shape) != want:
            raise CheckpointError(
                f"checkpoint's score.weight is {list(out['score'].shape)}; config.json's"
                f" {want[0]} labels and hidden size {want[1]} need {list(want)}"
            )
    for i in range(config.num_layers):
        a, m, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        out[p + "in_norm"] = take(f"model.layers.{i}.input_layernorm.weight")
        out[p + "post_norm"] = take(f"model.layers.{i}.post_attention_layernorm.weight")
        out[p + "qkv"] = torch.cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]
        ).t()
        if config.attention_bias:
            out[p + "qkv_bias"] = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")]
            )
        out[p + "o"] = take(a + "o_proj.weight").t()
        gate_up = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[p + "gate_up"] = gate_up.t()
        out[p + "down"] = take(m + "down_proj.weight").t()
    if hf:
        logger.warning("ignoring %d unused checkpoint tensors, e.g. %s", len(hf), next(iter(hf)))
    return {k: v.contiguous() for k, v in out.items()}


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory not found: {path}")
    return path
