"""kvrelay: a disaggregated LLM serving cluster.

``from kvrelay import LLM, SamplingParams, PoolingParams, LoRARequest`` loads the engine (and
torch) on first use only; ``import kvrelay`` itself is light, so the router never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvrelay.engine.llm import LLM
    from kvrelay.engine.lora import LoRARequest
    from kvrelay.protocol.pooling import PoolingParams
    from kvrelay.protocol.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvrelay.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from kvrelay.engine.lora import LoRARequest

        return LoRARequest
    if name == "PoolingParams":
        from kvrelay.protocol.pooling import PoolingParams

        return PoolingParams
    if name == "SamplingParams":
        from kvrelay.protocol.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
