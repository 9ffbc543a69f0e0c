"""GGUF file of a Llama-family model -> Hugging Face checkpoint directory.

``import_gguf(path, out_dir)`` reads a GGUF file (llama.cpp's format) whose
``general.architecture`` is ``llama``, ``mistral`` or ``qwen2`` and writes what every kvrelay
command loads: ``config.json``, ``model.safetensors`` (HF tensor names, dequantized to float32
or bfloat16), ``tokenizer.json`` and ``tokenizer_config.json`` (rebuilt from the
``tokenizer.ggml.*`` metadata, see ``gguf_tokenizer``), ``chat_template.jinja``,
``generation_config.json`` and ``kvrelay_import.json`` (where it came from).

Quantized tensors are dequantized by the ``gguf`` package (``gguf.quants.dequantize``).
llama.cpp's converter permutes the rows of a Llama ``q_proj``/``k_proj`` so that rotary pairs
are adjacent; the import undoes it (HF order: the two halves of each head)::

    HF rows of one head:   [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]
    GGUF rows of one head: [x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)]

Nothing is written to ``out_dir`` unless the whole import succeeds: the files go to a
temporary sibling directory that is renamed at the end and removed on any failure.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvrelay.engine.gguf_tokenizer import (
    GGUFImportError,
    Metadata,
    TokenizerFiles,
    build_tokenizer_files,
)

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
IMPORT_DTYPES = ("float32", "bfloat16")
# general.architecture -> HF architecture; the metadata keys are prefixed with the former.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})  # llama.cpp permutes their q/k rows
# Tensor types ``gguf.quants.dequantize`` reads; anything else is refused before writing.
SUPPORTED_TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
    | {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPORT_RECORD = "kvrelay_import.json"


@dataclass(frozen=True, slots=True)
class Hyperparams:
    """The model shape a GGUF file states (``{arch}.*`` keys)."""

    arch: str  # general.architecture
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int


def import_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", progress: bool = False
) -> Path:
    """Writes the Hugging Face checkpoint of ``gguf_path`` into ``out_dir``.

    Args:
        gguf_path: the GGUF file.
        out_dir: the directory to create; it must not exist or be empty.
        dtype: ``float32`` or ``bfloat16``, the dtype of the written tensors.
        progress: show a progress bar on stderr while dequantizing.

    Returns:
        ``out_dir``.

    Raises:
        GGUFImportError: not a GGUF file, a truncated one, another architecture, a tensor type
            or tokenizer that cannot be read, or ``out_dir`` holds files. Nothing is left in
            ``out_dir`` then.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    if dtype not in IMPORT_DTYPES:
        raise GGUFImportError(f"unknown dtype {dtype!r}; choose one of {', '.join(IMPORT_DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFImportError(f"{out} already exists and is not an empty directory")
    reader = open_gguf(gguf_path)
    meta = Metadata.from_reader(reader)
    hp = read_hyperparams(meta)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    _check_tensors(reader, hp)
    tok = build_tokenizer_files(meta, hp.context_length)
    config = _model_config(hp, meta, shapes, tok, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        tensors = dict(_hf_tensors(reader, hp, dtype, progress))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", config)
        tok.write(tmp)
        _write_json(tmp / IMPORT_RECORD, _import_record(gguf_path, dtype))
        # safetensors creates its file 0600; give it the mode (umask) of the files we wrote
        os.chmod(tmp / "model.safetensors", (tmp / IMPORT_RECORD).stat().st_mode & 0o777)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("imported %s (%s) into %s as %s", gguf_path.name, hp.arch, out, dtype)
    return out


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``; raises GGUFImportError for an unreadable file."""
    import gguf

    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFImportError(f"cannot read {path}: {exc.strerror}") from exc
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise GGUFImportError(f"{path} is truncated or corrupt: {exc}") from exc


def read_hyperparams(meta: Metadata) -> Hyperparams:
    arch = meta.get_str("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    hidden = meta.get_int(f"{arch}.embedding_length")
    num_heads = meta.get_int(f"{arch}.attention.head_count")
    head_dim = meta.get_int(f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = meta.get_int(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise GGUFImportError(f"partial rotary ({rotary_dim} of {head_dim} dims) is unsupported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", b"none"):
        raise GGUFImportError(f"unsupported rope scaling {scaling!r} ({arch}.rope.scaling.type)")
    return Hyperparams(
        arch=arch,
        num_layers=meta.get_int(f"{arch}.block_count"),
        hidden_size=hidden,
        intermediate_size=meta.get_int(f"{arch}.feed_forward_length"),
        num_heads=num_heads,
        num_kv_heads=meta.get_int(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.get_float(f"{arch}.rope.freq_base", 10000.0),
        context_length=meta.get_int(f"{arch}.context_length"),
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    base, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's rotary row permutation of a q/k weight ``[heads*d, in]`` or bias."""
    head_dim = w.shape[0] // num_heads
    grouped = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
    return grouped.swapaxes(1, 2).reshape(w.shape)


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _check_tensors(reader: Any, hp: Hyperparams) -> None:
    """Every tensor has an HF name and a readable type; every layer tensor is there."""
    names = set()
    for t in reader.tensors:
        if hf_tensor_name(t.name) is None:
            raise GGUFImportError(f"tensor {t.name!r} has no Hugging Face {hp.arch} counterpart")
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFImportError(
                f"tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized; "
                f"supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))}"
            )
        names.add(t.name)
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{i}.{n}.weight" for i in range(hp.num_layers) for n in _LAYER_TENSORS]
    missing = [n for n in required if n not in names]
    if missing:
        raise GGUFImportError(f"the file lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")


def _hf_tensors(
    reader: Any, hp: Hyperparams, dtype: str, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        assert name is not None  # _check_tensors
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        expected = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if w.shape != expected:
            w = w.reshape(expected)
        if hp.arch in PERMUTED_ARCHITECTURES and ".attn_q." in t.name:
            w = unpermute_rows(w, hp.num_heads)
        elif hp.arch in PERMUTED_ARCHITECTURES and ".attn_k." in t.name:
            w = unpermute_rows(w, hp.num_kv_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:  # a view of the mapped file
            w = np.array(w, order="C")
        yield name, torch.from_numpy(w).to(_TORCH_DTYPES[dtype])


def _model_config(
    hp: Hyperparams,
    meta: Metadata,
    shapes: dict[str, tuple[int, ...]],
    tok: TokenizerFiles,
    dtype: str,
) -> dict[str, Any]:
    """config.json as transformers writes it for the architecture."""
    if hp.arch == "qwen2" and "blk.0.attn_q.bias" not in shapes:
        raise GGUFImportError("a qwen2 file without q/k/v biases (blk.0.attn_q.bias)")
    vocab_size = shapes["token_embd.weight"][0]
    if vocab_size < tok.backend.get_vocab_size(with_added_tokens=True):
        raise GGUFImportError(
            f"the tokenizer has {tok.backend.get_vocab_size()} tokens, the embedding {vocab_size}"
        )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[hp.arch]],
        "model_type": hp.arch,
        "attention_dropout": 0.0,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "dtype": dtype,
        "hidden_act": "silu",
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "max_position_embeddings": hp.context_length,
        "num_attention_heads": hp.num_heads,
        "num_hidden_layers": hp.num_layers,
        "num_key_value_heads": hp.num_kv_heads,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_parameters": {"rope_theta": hp.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in shapes,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    bias = "blk.0.attn_q.bias" in shapes
    if hp.arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    else:
        config.update(head_dim=hp.head_dim, attention_bias=bias, mlp_bias=False)
    if hp.arch == "mistral":
        window = meta.get(f"{hp.arch}.attention.sliding_window")
        config["sliding_window"] = int(window) if window else None
    return config


def _import_record(gguf_path: Path, dtype: str) -> dict[str, Any]:
    from kvrelay import __version__

    return {
        "source": gguf_path.name,
        "sha256": sha256_file(gguf_path),
        "dtype": dtype,
        "kvrelay_version": __version__,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
