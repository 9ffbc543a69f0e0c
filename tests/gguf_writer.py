"""Writes GGUF files for the tests the way llama.cpp's ``convert_hf_to_gguf.py`` does.

``write_gguf(hf_dir, path, qtype)`` turns a ``make_tiny`` checkpoint into a GGUF file with the
``gguf`` package's ``GGUFWriter``: llama.cpp's metadata keys and tensor names, the rotary row
permutation of Llama q/k weights, 2-D weights in ``qtype`` (norms and biases stay F32) and
the tokenizer as ``tokenizer.ggml.*`` arrays.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from kvrelay.engine.make_tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

Q = gguf.GGMLQuantizationType
HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in HF_TO_GGUF:
        return f"{HF_TO_GGUF[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}.{suffix}"


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: the halves of each head's rows interleaved."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    hf_dir: Path,
    path: Path,
    qtype: gguf.GGMLQuantizationType = Q.F32,
    arch: str | None = None,
    encode: Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    metadata: dict[str, object] | None = None,
) -> Path:
    """Writes ``hf_dir`` as a GGUF file; returns ``path``.

    Args:
        qtype: type of the 2-D weights (F32, F16 or a type ``gguf.quants.quantize`` writes).
        arch: general.architecture (default: config.json's model_type).
        encode: ``(gguf name, float32 array) -> (array, type)`` instead of ``qtype``.
        metadata: extra or replaced key/values (a value of None removes the key).
    """
    config = json.loads((hf_dir / "config.json").read_text())
    arch = arch or config["model_type"]
    writer = gguf.GGUFWriter(str(path), arch)
    kv = _metadata(hf_dir, config, arch)
    kv.update(metadata or {})
    for key, value in kv.items():
        if value is not None:
            _add_kv(writer, key, value)
    for hf_name, w in load_file(str(hf_dir / "model.safetensors")).items():
        name = gguf_name(hf_name)
        w = w.astype(np.float32)
        if arch in ("llama", "mistral") and ".attn_q." in name:
            w = permute_rows(w, config["num_attention_heads"])
        elif arch in ("llama", "mistral") and ".attn_k." in name:
            w = permute_rows(w, config["num_key_value_heads"])
        data, kind = encode(name, w) if encode else _encode(w, qtype)
        if kind in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, Q]:
    if w.ndim == 1 or qtype == Q.F32:
        return w, Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    return gguf.quants.quantize(w, qtype), qtype


def _metadata(hf_dir: Path, config: dict, arch: str) -> dict[str, object]:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = set(SPECIAL_TOKENS)
    return {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.rope.freq_base": float(config["rope_parameters"]["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.dimension_count": config["hidden_size"] // config["num_attention_heads"],
        f"{arch}.vocab_size": len(tokens),
        "general.name": f"tiny {arch}",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 3,
        "tokenizer.ggml.padding_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def _add_kv(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and value and isinstance(value[0], int):
        writer.add_array(key, value)  # int32 items (token types)
    else:
        writer.add_array(key, list(value))  # type: ignore[call-overload]
