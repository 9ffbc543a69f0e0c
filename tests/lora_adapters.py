"""PEFT LoRA adapters for tests, written by ``peft`` itself (its ``save_pretrained``).

``peft`` initialises ``lora_B`` to zero (an adapter that changes nothing), so every LoRA
matrix is drawn at random here, scaled to move the logits clearly without swamping the base.
"""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    targets: tuple[str, ...] = ALL_TARGETS,
    r: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    std: float = 0.05,
) -> Path:
    """A random LoRA adapter for the checkpoint in ``model_dir``, saved in ``out_dir``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    wrapped.save_pretrained(out_dir)
    return out_dir


def peft_logits(model_dir: Path, adapter_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """The last position's float32 logits of ``token_ids`` through the adapter, as ``peft``
    computes them (the base model with the adapter's layers beside its projections)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        out = wrapped(torch.tensor([token_ids])).logits
    return out[0, -1].float()


def base_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()
