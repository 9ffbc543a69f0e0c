"""A CPU decode step's decoder layers in one native call (``csrc/decode.c``).

With the matmuls at the memory bound (``gemv``) and attention reading the pool in place
(``cpu_attention``), what remained of a lone sequence's decode step was the ~45 small torch
ops per layer between them (norms, rotary, slicing, residuals, SiLU) and the Python that issues
them: about as long as the weights' bytes took (BENCHMARKS.md, engine step profile). For steps
of decode tokens only, at most ``gemv.MAX_ROWS`` of them, ``LlamaModel.forward`` hands every
layer to ``decode_forward``, which runs the same ops in the same order, rounding a bfloat16
model's values where torch's ops round them. It is on when both native matmuls and native
attention are (``KVRELAY_NATIVE_MATMUL``, ``KVRELAY_NATIVE_ATTENTION``).

A float32 model whose projections have panels (``kernels.cpu_panels``, the packed copies on an
AVX2 CPU) runs its batched decode steps here too: the products of more than ``native_rows``
rows on the panels, as the torch path's are, and the rest of each layer without the ~1,700
Python-issued ops of a 30-layer step (8-10 ms of a 49-64-row SmolLM2 step: the K/V stores,
the calls around attention, slicing; BENCHMARKS.md "Batched decode steps in one native call").
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import torch

from kvrelay.engine.config import ModelConfig
from kvrelay.kernels import cpu_attention, cpu_panels, gemv
from kvrelay.kernels.cpu_attention import NativeDecode

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_PER_LAYER = ("in_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")  # decode.c
_PANELS = ("qkv", "o", "gate_up", "down")  # decode.c's P_* order


class _Model(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("layers", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("q_heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("window", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("weights", ctypes.POINTER(ctypes.c_void_p)),
        ("kv", ctypes.c_void_p),
        ("kv_layer_elems", ctypes.c_int64),
        ("panels", ctypes.POINTER(ctypes.c_void_p)),
        ("panels_from", ctypes.c_int),
        ("threads", ctypes.c_int),
    ]


def wide_panels(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], packed: Mapping[str, object]
) -> dict[str, cpu_panels.Panels] | None:
    """The panels of every projection of a float32 model, for steps of more rows than gemv
    takes (``FusedDecode``'s ``panels``); None when any is missing (still being packed, or
    oneDNN's copies where panels are not the kernel) or the model is not float32."""
    if weights["embed"].dtype != torch.float32:
        return None
    names = [f"layers.{i}.{n}" for i in range(config.num_layers) for n in _PANELS]
    found = {n: packed.get(n) for n in names}
    if not all(isinstance(p, cpu_panels.Panels) for p in found.values()):
        return None
    return found  # type: ignore[return-value]


class FusedDecode:
    """The native model description for one (weights, KV pool, panels) triple, built once.

    ``panels``: every projection's panels (``wide_panels``), so that steps of more than
    ``panels_from`` rows run here too; None: steps of up to ``gemv.MAX_ROWS`` rows only.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        kv_cache: torch.Tensor,
        panels: Mapping[str, cpu_panels.Panels] | None = None,
        panels_from: int = gemv.MAX_ROWS,
    ) -> None:
        library = gemv.load_library()
        if library is None:
            raise RuntimeError("FusedDecode needs the compiled library")
        self._run = library.decode_forward  # signature set by gemv.load_library
        self.kv_cache = kv_cache
        pointers = [
            weights[f"layers.{i}.{name}"].data_ptr() if f"layers.{i}.{name}" in weights else None
            for i in range(config.num_layers)
            for name in _PER_LAYER
        ]
        self._weights = (ctypes.c_void_p * len(pointers))(*pointers)
        self.panels = panels
        self._panels = None
        if panels is not None:
            wp = [panels[f"layers.{i}.{n}"].data.data_ptr()
                  for i in range(config.num_layers) for n in _PANELS]  # fmt: skip
            self._panels = (ctypes.c_void_p * len(wp))(*wp)
        self._model = _Model(
            _DTYPES[kv_cache.dtype],
            config.num_layers,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            kv_cache.shape[3],
            config.sliding_window or 0,
            config.rms_norm_eps,
            config.head_dim**-0.5,
            self._weights,
            kv_cache.data_ptr(),
            kv_cache[0].numel(),
            self._panels,
            panels_from,
            1,
        )

    @staticmethod
    def supports(
        config: ModelConfig, weights: Mapping[str, torch.Tensor], kv_cache: torch.Tensor
    ) -> bool:
        """True when this model's decode steps can run natively on this pool."""
        names = [f"layers.{i}.{n}" for i in range(config.num_layers) for n in _PER_LAYER]
        return (
            cpu_attention.supports(kv_cache, config.num_heads)  # the library is loaded
            and kv_cache.is_contiguous()
            and config.head_dim % 2 == 0
            and all(
                weights[n].dtype == kv_cache.dtype and weights[n].is_contiguous()
                for n in names
                if n in weights
            )
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: NativeDecode,
        slots: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Every layer for the decode rows of ``x`` ([m, hidden] embeddings, updated and
        returned); ``cos``/``sin`` ``[m, 1, head_dim / 2]`` from ``LlamaModel.rotary``."""
        x = x.contiguous()
        self._model.threads = torch.get_num_threads()  # the panels' chunks (cpu_panels)
        cos, sin = (
            cos.reshape(x.shape[0], -1).contiguous(),
            sin.reshape(x.shape[0], -1).contiguous(),
        )
        code = self._run(
            ctypes.addressof(self._model),
            x.shape[0],
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            batch.rows.data_ptr(),
            batch.tables.data_ptr(),
            batch.tables.shape[1],
            batch.ctx_lens.data_ptr(),
        )
        if code != 0:
            raise RuntimeError(f"native decode step failed ({code}) for {x.shape[0]} tokens")
        return x
