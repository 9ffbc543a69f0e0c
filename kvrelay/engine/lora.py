"""LoRA adapters: PEFT checkpoints served beside their base model, many in one batch.

An adapter directory is what ``peft``'s ``save_pretrained`` writes: ``adapter_config.json``
and ``adapter_model.safetensors``, with ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``
per adapted projection. A projection ``y = x W`` of the base becomes
``y = x W + scale * (x A^T) B^T`` for the rows of the sequences that ask for the adapter;
the other rows of the same step keep the base weights (vLLM's multi-LoRA batching, without
merging anything into the shared weights).

At load, an adapter's matrices are fused the way the base's are (``loader.prepare_weights``):
per layer one ``A [in, r_q + r_k + r_v]`` and a block-diagonal ``B [r_q + r_k + r_v, q + k +
v]`` for the ``qkv`` projection, likewise ``gate_up``; ``o`` and ``down`` alone. ``scale``
(``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``) is folded into ``B``; they are
kept in the base's dtype and in float32 (for a few rows). A step computes each adapter's two
small matmuls over its rows only (``LoRABatch.add``), which the runner makes one contiguous
span per adapter.

Supported: targets among ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``, any
rank per module (``rank_pattern``), rsLoRA, ``layers_to_transform``. Refused with a
``LoRAError`` naming the setting: DoRA, ``alpha_pattern``, trained biases, ``modules_to_save``
or ``trainable_token_indices`` (retrained embeddings or head), other target modules, the
variants PEFT marks by a config flag (QA-LoRA, activated LoRA, ...), a weights file in
pickle format.

An adapter's identity (``LoRAAdapter.fingerprint``: the digest of its config and weights
files) goes into every KV block hash its requests make (``block_hash.chain_seed``): KV
computed under one adapter is never reused for another, or for the base, in any tier.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from safetensors import safe_open

from kvrelay.engine.config import ModelConfig
from kvrelay.engine.identity import cached_file_digest
from kvrelay.kernels import gemv
from kvrelay.protocol.lora_modules import check_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DOMAIN = b"kvrelay-lora-v1\0"
SMALL_ROWS = 16  # an adapter's rows in a step up to which it computes in float32

# PEFT module name -> (runtime projection, part of its fused output)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the file or setting."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest`` for ``LLM.generate``: the adapter a request runs through, loaded
    on first use. ``lora_int_id`` is accepted for vLLM's signature; kvrelay keys adapters by
    name."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    name: str
    path: str
    fingerprint: bytes  # 16 bytes: the config and weights files' digests
    rank: int  # the largest rank of its modules
    # runtime projection name ("layers.3.qkv") -> (A [in, r], B [r, out] with the scale in it),
    # in the base's dtype
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    # the same in float32, for spans of at most SMALL_ROWS rows (``LoRABatch.add``)
    small: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_modules(self) -> int:
        return len(self.weights)


def adapter_identity(path: str | Path) -> bytes:
    """The 16-byte identity of the adapter in ``path``: its config and weights files."""
    path = Path(path)
    h = blake3.blake3(_DOMAIN)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = path / name
        h.update(name.encode() + b"\0" + file.stat().st_size.to_bytes(8, "little"))
        h.update(cached_file_digest(file))
    return h.digest(16)


def load_adapter(
    name: str,
    path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoRAAdapter:
    """Reads and fuses the PEFT adapter in ``path`` for a base model of ``config``."""
    check_name(name)
    path = Path(path)
    cfg = _read_config(path)
    _check_config(cfg, path)
    modules = _read_modules(path, config)
    scale_of = _scaling(cfg)
    sizes = _output_sizes(config)
    fan_ins = {"qkv": config.hidden_size, "o": config.num_heads * config.head_dim,
               "gate_up": config.hidden_size, "down": config.intermediate_size}  # fmt: skip
    by_projection: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), (a, b) in sorted(modules.items()):
        projection, part = TARGETS[module]
        rank, fan_in = a.shape[0], fan_ins[projection]
        if a.shape[1] != fan_in or b.shape != (sizes[projection][part], rank):
            raise LoRAError(
                f"{path / WEIGHTS_FILE}: layer {layer} {module} has lora_A {list(a.shape)} and "
                f"lora_B {list(b.shape)}, which do not fit this model ({fan_in} in, "
                f"{sizes[projection][part]} out)"
            )
        b = b.double() * scale_of(rank)
        by_projection.setdefault(f"layers.{layer}.{projection}", []).append((part, a, b))
    small = {
        key: _fuse(parts, sizes[key.rsplit(".", 1)[1]], device)
        for key, parts in by_projection.items()
    }
    weights = small
    if dtype != torch.float32:
        weights = {key: (a.to(dtype), b.to(dtype)) for key, (a, b) in small.items()}
    rank = max(a.shape[0] for a, _ in modules.values())
    return LoRAAdapter(name, str(path), adapter_identity(path), rank, weights, small)


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter directory not found: {path}")
    if not file.is_file():
        raise LoRAError(f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{file} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{file} is not a JSON object")
    return cfg


def _check_config(cfg: dict, path: Path) -> None:
    where = path / CONFIG_FILE
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "alpha_pattern": "a per-module lora_alpha (alpha_pattern) is not supported",
        "modules_to_save": "modules_to_save (retrained embeddings or head) is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "lora_bias": "trained LoRA biases (lora_bias) are not supported",
        "trainable_token_indices": "retrained token embeddings are not supported",
        "target_parameters": "target_parameters (LoRA on bare parameters) is not supported",
        "layer_replication": "layer_replication is not supported",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
        "use_qalora": "QA-LoRA is not supported",
        "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise LoRAError(f"{where}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{where}: trained biases (bias={cfg['bias']!r}) are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        other = sorted(set(targets) - set(TARGETS))
        if other:
            raise LoRAError(
                f"{where}: target modules {other} are not supported (only {', '.join(TARGETS)})"
            )
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoRAError(f"{where}: {key} must be a positive number, got {value!r}")


def _scaling(cfg: dict) -> Callable[[int], float]:
    alpha, rslora = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora"))

    def scale(rank: int) -> float:
        return alpha / math.sqrt(rank) if rslora else alpha / rank

    return scale


def _read_modules(
    path: Path, config: ModelConfig
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickled = path / "adapter_model.bin"
        if pickled.is_file():
            raise LoRAError(
                f"{pickled} is a pickle, which kvrelay does not load: save the adapter with "
                "safetensors (peft's save_pretrained does by default)"
            )
        raise LoRAError(f"{path} has no {WEIGHTS_FILE}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            m = _KEY.fullmatch(key)
            if m is None or m.group(2) not in TARGETS:
                raise LoRAError(f"{file}: tensor {key!r} is not a LoRA matrix kvrelay applies")
            layer = int(m.group(1))
            if layer >= config.num_layers:
                raise LoRAError(f"{file}: {key!r} names layer {layer} of {config.num_layers}")
            halves.setdefault((layer, m.group(2)), {})[m.group(3)] = f.get_tensor(key)
    if not halves:
        raise LoRAError(f"{file} holds no LoRA matrices")
    modules = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{file}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{file}: layer {layer} {module}: lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} do not make a rank-r product"
            )
        modules[layer, module] = (a, b)
    return modules


def _output_sizes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per runtime projection, the widths of its fused parts (q, k, v; gate, up)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {"qkv": (q, kv, kv), "o": (config.hidden_size,), "gate_up": (inter, inter),
            "down": (config.hidden_size,)}  # fmt: skip


def _fuse(
    parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    widths: tuple[int, ...],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``A [in, sum r]`` and block-diagonal ``B [sum r, sum widths]`` for a projection's
    adapted parts; the parts it does not adapt are zero columns of ``B``."""
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    total_rank = sum(a.shape[0] for _, a, _ in parts)
    a_fused = torch.cat([a.double() for _, a, _ in parts]).t()
    b_fused = torch.zeros(total_rank, sum(widths), dtype=torch.float64)
    row = 0
    for part, a, b in parts:
        rank = a.shape[0]
        b_fused[row : row + rank, offsets[part] : offsets[part] + widths[part]] = b.t()
        row += rank
    return (
        a_fused.to(torch.float32).contiguous().to(device),
        b_fused.to(torch.float32).contiguous().to(device),
    )


class LoRABatch:
    """A step's adapters, each with the rows (tokens) that use it: one contiguous span per
    adapter, since the runner orders a step's sequences by adapter (``ModelRunner.run``), so
    an adapter's rows are a view of the step's activations, with no gather or scatter."""

    def __init__(self, spans: list[tuple[LoRAAdapter, int, int]], num_rows: int) -> None:
        self.spans = spans  # (adapter, first row, end row)
        self.num_rows = num_rows

    @classmethod
    def build(cls, row_adapters: Sequence[tuple[LoRAAdapter | None, int]]) -> LoRABatch | None:
        """From ``(adapter, row count)`` per scheduled sequence, in row order, each adapter's
        sequences adjacent; None when no row uses an adapter."""
        spans: list[tuple[LoRAAdapter, int, int]] = []
        row = 0
        for adapter, count in row_adapters:
            if adapter is not None:
                if spans and spans[-1][0] is adapter and spans[-1][2] == row:
                    spans[-1] = (adapter, spans[-1][1], row + count)
                else:
                    spans.append((adapter, row, row + count))
            row += count
        return cls(spans, row) if spans else None

    def add(self, key: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds to ``out`` (the base projection ``key`` of ``x``, in place) each adapter's
        ``(x A) B`` on its rows: in float32 for a span of at most ``SMALL_ROWS`` rows (on CPU a
        bfloat16 matmul of a few rows costs ~4x a float32 one), else in the base's dtype
        (there a float32 product costs more than the base projection: BENCHMARKS.md "LoRA");
        always in float32 where torch's bfloat16 products are slow (``gemv.widens_bfloat16``)."""
        widen = gemv.widened(x)
        for adapter, start, end in self.spans:
            small = widen or end - start <= SMALL_ROWS
            pair = (adapter.small if small else adapter.weights).get(key)
            if pair is None:
                continue
            a, b = pair
            whole = start == 0 and end == self.num_rows
            rows = x if whole else x[start:end]
            if rows.dtype != a.dtype:
                rows = rows.to(a.dtype)
            (out if whole else out[start:end]).add_((rows @ a) @ b)
        return out
