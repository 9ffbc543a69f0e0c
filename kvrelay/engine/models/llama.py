"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Selective batching: every token of a step is one row of a flat ``[T, hidden]`` tensor for
embeddings, norms, projections and the MLP; only attention is split per sequence, in
``kvrelay.kernels.attention``. The model holds no parameters of its own: it reads a flat
dict of runtime tensors (``loader.prepare_weights``), so weights can live in a shared pool.

Runtime weight names: ``embed``, ``norm``, ``lm_head`` (absent when tied), ``score`` (a
classifier's head, ``[labels, hidden]``) and, per layer
``i``: ``layers.i.in_norm``, ``layers.i.qkv``, ``layers.i.qkv_bias`` (Qwen2), ``layers.i.o``,
``layers.i.post_norm``, ``layers.i.gate_up``, ``layers.i.down``.

Projection weights (``qkv``, ``o``, ``gate_up``, ``down`` and an untied ``lm_head``) are
stored transposed, ``[in, out]``, and applied as ``x @ w``: on CPU, MKL's sgemm runs 2-4x
faster in that layout for the 8-48-row batches that decode steps make (and no slower for
prefill-sized ones), and batches of up to ``gemv.MAX_ROWS`` rows go to kvrelay's native
kernel, which streams each weight once on all threads. A tied ``embed`` stays
``[vocab, hidden]`` and serves both ends.

On CPU a layer's small ops (residual add + RMSNorm, rotary embedding, SiLU-and-multiply) run
as one native call each (``kernels.cpu_rows``), and on a GPU as one Triton launch each
(``kernels.triton_rows``), with the rounding of the torch ops below, which stay for the
rest (and for ``KVRELAY_TRITON_ROWS=0``); decode-only steps of a few rows run every layer in
one native call (``kernels.cpu_decode``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from types import ModuleType

import torch
import torch.nn.functional as F

from kvrelay.engine import background
from kvrelay.engine.config import ModelConfig, RopeConfig
from kvrelay.engine.lora import LoRABatch
from kvrelay.kernels import cpu_decode, cpu_packed, cpu_rows, gemv, triton_rows
from kvrelay.kernels.attention import AttentionMetadata, paged_attention
from kvrelay.kernels.cpu_decode import FusedDecode

logger = logging.getLogger(__name__)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies, with linear or Llama-3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [T, H, D]`` by half-split pairs (the Hugging Face checkpoint convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, then scaled in ``x``'s dtype, as the reference does.

    One fused op for float32 (the same bits as the unfused ``x * rsqrt(mean(x^2) + eps)``).
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


RowOps = ModuleType  # cpu_rows or triton_rows: add_rms_norm, rope_, silu_mul


def row_ops(x: torch.Tensor, gpu_rows: bool) -> RowOps | None:
    """The fused row ops for activations like ``x``: the native library's on CPU
    (``kernels.cpu_rows``), Triton's on a GPU (``kernels.triton_rows``) where ``gpu_rows``
    (the model's ``triton_rows.enabled()``, read once); None: torch's ops."""
    if cpu_rows.supports(x):
        return cpu_rows
    if gpu_rows and x.device.type == "cuda" and triton_rows.fits(x):
        return triton_rows
    return None


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    rows: RowOps | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(x + delta, rms_norm(x + delta) * weight)`` (``delta`` None: ``x`` itself). The fused
    row ops (``row_ops``) add in place and do both in one call."""
    if rows is not None:
        return x, rows.add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: cpu_packed.Packed | None = None,
    native_rows: int = gemv.MAX_ROWS,
) -> torch.Tensor:
    """``x @ w + bias`` for a weight stored ``[in, out]`` (decode-sized batches on CPU in the
    native kernel, ``kernels.gemv``; more than ``native_rows`` rows on ``w``'s ``packed`` copy
    when there is one, ``kernels.cpu_packed``; anything else in torch)."""
    if packed is not None and x.shape[0] > native_rows:
        return cpu_packed.linear(x, packed, bias)
    return gemv.matmul(x, w, bias)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights["embed"].dtype
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim).to(weights["embed"].device)
        self.scale = config.head_dim**-0.5
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        self._qk_heads = config.num_heads + config.num_kv_heads
        self._fused: FusedDecode | None = None  # built for the first KV pool it can serve
        # the packed copies _fused_for last saw, and their panels for wide fused steps
        self._wide: tuple[dict | None, dict | None] = (None, None)
        self.gpu_rows = triton_rows.enabled()  # Triton's row ops for CUDA steps (``row_ops``)
        # oneDNN-blocked copies of the projections for steps of many rows (kernels.cpu_packed):
        # made now, or on a thread while the engine serves on the plain weights; a step reads
        # ``self.packed`` once, and the thread replaces the empty dict with the whole set
        names = [f"layers.{i}.{n}" for i in range(config.num_layers)
                 for n in ("qkv", "o", "gate_up", "down")]  # fmt: skip
        if config.generates:  # an embedding checkpoint has no head
            names.append("lm_head" if "lm_head" in weights else "embed")  # tied: the embedding
        size = sum(cpu_packed.copy_bytes(weights[n], transposed=n != "embed") for n in names)
        how = cpu_packed.plan(weights, size)
        # steps of up to this many rows take the native kernels (the whole step in one call
        # when it is decode tokens only); more rows take the packed copies once they exist
        self.native_rows = cpu_packed.native_rows(self.dtype) if how else gemv.MAX_ROWS
        self.packed: dict[str, cpu_packed.Packed] = self._pack(names, size) if how == "now" else {}
        self._packer: threading.Thread | None = None
        if how == "background":
            self._packer = threading.Thread(
                target=self._pack_in_background, args=(names, size), name="kvrelay-pack",
                daemon=True,
            )  # fmt: skip
            self._packer.start()

    def wait_packed(self, timeout: float | None = None) -> bool:
        """Waits for a background packing (benchmarks, tests); True once none is running."""
        if self._packer is not None:
            self._packer.join(timeout)
        return self._packer is None or not self._packer.is_alive()

    def _pack_in_background(self, names: list[str], size: int) -> None:
        background.lower_priority()  # the first requests' steps come first
        try:
            packed = self._pack(names, size)
        except Exception:  # the plain weights keep serving
            logger.exception("packing the weights for oneDNN failed; steps use the plain ones")
            return
        self.packed = packed

    def _pack(self, names: list[str], size: int) -> dict[str, cpu_packed.Packed]:
        """Packed copies of ``names`` (``size`` bytes in all, for the log)."""
        started = time.perf_counter()
        # stored [in, out], but a tied embedding [vocab, hidden]
        packed = {n: cpu_packed.pack(self.weights[n], transposed=n != "embed") for n in names}
        logger.info("packed %d weights (%s) in %.2f s: %.0f MB beside the plain ones",
                    len(packed), cpu_packed.kernel(), time.perf_counter() - started,
                    size / 1e6)  # fmt: skip
        return packed

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, 1, head_dim / 2]`` for the given positions."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        return freqs.cos().to(self.dtype).unsqueeze(1), freqs.sin().to(self.dtype).unsqueeze(1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm) for a flat batch of tokens.

        ``kv_cache`` is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; this
        step's K/V are written into it at ``meta.slot_mapping``. ``lora``: the LoRA adapters
        of the step's rows (``engine.lora``); such a step runs layer by layer.
        """
        x, cos, sin = self.embed(input_ids, positions)
        fused = None if lora is not None else self._fused_for(kv_cache, meta, x.shape[0])
        if fused is not None and meta.native_decode is not None:
            return fused.forward(x, cos, sin, meta.native_decode, meta.slot_mapping)
        delta: torch.Tensor | None = None  # the last block's output, not yet added to x
        for i in range(self.config.num_layers):
            x, q, k, v = self.layer_in(i, x, delta, cos, sin, lora)
            attn = paged_attention(q, k, v, kv_cache[i], meta, self.scale)
            x, delta = self.layer_out(i, x, attn, lora)
        return x if delta is None else x + delta

    # The forward in pieces: ``embed``, then per layer ``layer_in``, attention, ``layer_out``.
    # With SDPA's prefill a GPU step replays the pieces around attention as CUDA graphs
    # (``engine.cuda_graphs.LayerGraphs``); the eager forward above is the same calls.
    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens' embeddings ``[T, hidden]`` and their rotary ``cos, sin``."""
        cos, sin = self.rotary(positions)
        return F.embedding(input_ids, self.weights["embed"]), cos, sin

    def layer_in(
        self,
        i: int,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i`` up to attention: the residual ``x + delta`` (``delta`` the last layer's
        output, None before the first) and this layer's rotated ``q, k`` and ``v``."""
        w, cfg, hd = self.weights, self.config, self.config.head_dim
        p, ops = f"layers.{i}.", row_ops(x, self.gpu_rows)  # small ops fused (library, Triton)
        x, h = add_rms_norm(x, delta, w[p + "in_norm"], cfg.rms_norm_eps, ops)
        qkv = linear(h, w[p + "qkv"], w.get(p + "qkv_bias"), self.packed.get(p + "qkv"),
                     self.native_rows)  # fmt: skip
        if lora is not None:
            lora.add(p + "qkv", h, qkv)
        qk_size = self._q_size + self._kv_size
        # q and k rotate in one call: their columns are adjacent in the fused projection
        if ops is not None:
            ops.rope_(qkv, self._qk_heads, hd, cos, sin)
            qk = qkv[:, :qk_size].view(-1, self._qk_heads, hd)
        else:
            qk = apply_rope(qkv[:, :qk_size].view(-1, self._qk_heads, hd), cos, sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        return x, q, k, qkv[:, qk_size:].view(-1, cfg.num_kv_heads, hd)

    def layer_out(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, lora: LoRABatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` from its attention output ``[T, q_heads, head_dim]``: the residual and
        the MLP's output, which the next ``layer_in`` (or the caller, after the last) adds."""
        w, pk, rows = self.weights, self.packed, self.native_rows
        p, ops = f"layers.{i}.", row_ops(x, self.gpu_rows)
        attn = attn.reshape(-1, self._q_size)
        delta = linear(attn, w[p + "o"], None, pk.get(p + "o"), rows)
        if lora is not None:
            lora.add(p + "o", attn, delta)
        x, h = add_rms_norm(x, delta, w[p + "post_norm"], self.config.rms_norm_eps, ops)
        gate_up = linear(h, w[p + "gate_up"], None, pk.get(p + "gate_up"), rows)
        if lora is not None:
            lora.add(p + "gate_up", h, gate_up)
        if ops is not None:
            act = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = linear(act, w[p + "down"], None, pk.get(p + "down"), rows)
        return x, out if lora is None else lora.add(p + "down", act, out)

    def _fused_for(
        self, kv_cache: torch.Tensor, meta: AttentionMetadata, rows: int
    ) -> FusedDecode | None:
        """The native whole-step path (``kernels.cpu_decode``) when this step is decode tokens
        only, at most ``native_rows`` of them (more where a float32 model's projections all
        have panels: ``cpu_decode.wide_panels``), and the model and pool allow it."""
        batch = meta.native_decode
        if batch is None or meta.prefills or meta.native_prefill or meta.decode:
            return None
        packed = self.packed  # read once: the packing thread replaces it
        if self._wide[0] is not packed:
            self._wide = (packed, cpu_decode.wide_panels(self.config, self.weights, packed))
        panels = self._wide[1]
        if rows > self.native_rows and panels is None:
            return None
        if batch.row_table is not None:  # prefill tokens among the rows
            return None
        if kv_cache.device.type != "cpu":
            return None
        if batch.rows.numel() != rows:
            return None
        fused = self._fused
        if (
            fused is None
            or fused.kv_cache.data_ptr() != kv_cache.data_ptr()
            or fused.panels is not panels
        ):
            if not FusedDecode.supports(self.config, self.weights, kv_cache):
                return None
            fused = self._fused = FusedDecode(
                self.config, self.weights, kv_cache, panels, self.native_rows
            )
        return fused

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of ``forward``'s rows: the states embeddings pool (as
        transformers' ``last_hidden_state``)."""
        return rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)

    @torch.inference_mode()
    def classify(self, state: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's float32 logits ``[labels]`` for one pooled ``state``
        (``final_norm``'s output, as float32): its ``score`` head in the model's dtype, as
        transformers' ``*ForSequenceClassification`` computes it."""
        score = self.weights["score"]
        return torch.nn.functional.linear(state.to(score.dtype), score).float()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for the rows of ``hidden`` that are sampled."""
        h = rms_norm(hidden, self.weights["norm"], self.config.rms_norm_eps)
        tied = "lm_head" not in self.weights
        packed = self.packed.get("embed" if tied else "lm_head")
        if packed is not None and h.shape[0] > self.native_rows:
            return cpu_packed.linear(h, packed).float()
        if tied:
            return gemv.matmul_nt(h, self.weights["embed"]).float()  # embed [vocab, hidden]
        return linear(h, self.weights["lm_head"]).float()
