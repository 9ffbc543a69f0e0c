"""Whether the engine can run a request, checked before anything is queued: the tokens
against the context window and the vocabulary, the sampling parameters against the model,
its adapters and scheduling policy, an embedding request's pooling against the model.
Each check raises ``RequestError`` naming the field at fault."""

from __future__ import annotations

from collections.abc import Collection

from kvrelay.engine.config import EngineConfig, ModelConfig
from kvrelay.protocol.pooling import PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot run (too long, bad parameters); nothing was queued.

    ``param`` names the request field at fault when the client sent something invalid (a
    schema that does not compile); None for limits of this engine.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_generates(model_config: ModelConfig) -> None:
    """A generation request needs an LM head; a checkpoint without one says what it serves."""
    if model_config.generates:
        return
    serves = (
        "classifies and scores only (/classify, /score, /rerank, LLM.classify)"
        if model_config.classifier is not None
        else "computes embeddings only (/v1/embeddings, LLM.embed)"
    )
    raise RequestError(
        f"this model ({model_config.architecture}) has no LM head: it {serves}", param="model"
    )


def check_pooling(model_config: ModelConfig, pooling: PoolingParams) -> None:
    """An embedding request's ``dimensions`` against the model's (a classifier has none)."""
    hidden = model_config.hidden_size
    if pooling.dimensions is not None and model_config.classifier is not None:
        raise RequestError(
            "'dimensions' applies to embeddings; this model classifies (one score per label)",
            param="dimensions",
        )
    if pooling.dimensions is not None and pooling.dimensions > hidden:
        raise RequestError(
            f"'dimensions' is {pooling.dimensions}; this model's embeddings have {hidden}",
            param="dimensions",
        )


def check_tokens(
    config: EngineConfig,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    pooled: bool = False,
) -> None:
    """The prompt (and outputs already generated elsewhere) fit the context window, leaving
    a token to generate unless ``pooled``, and every id is in the vocabulary."""
    max_len = config.scheduler.max_model_len
    vocab = config.model_config.vocab_size
    if not prompt_token_ids:
        raise RequestError("prompt is empty")
    num_tokens = len(prompt_token_ids) + len(output_token_ids)
    if pooled and num_tokens > max_len:
        raise RequestError(
            f"input has {num_tokens} tokens; this model's context window is {max_len}"
        )
    if not pooled and num_tokens >= max_len:
        raise RequestError(
            f"prompt has {num_tokens} tokens; this model's context window is "
            f"{max_len} tokens and at least one must be left for output"
        )
    tokens = (*prompt_token_ids, *output_token_ids)
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is out of range [0, {vocab})")


def check_params(
    config: EngineConfig,
    params: SamplingParams,
    loras: Collection[str],
    eos_token_ids: Collection[int],
) -> None:
    """The params' token ids against the vocabulary and eos, their adapter among ``loras``
    (the names loaded), a priority only where the engine schedules by it."""
    error = params.vocab_error(config.model_config.vocab_size)
    if error is not None:
        raise RequestError(error[1], param=error[0])
    if params.lora_name is not None and params.lora_name not in loras:
        loaded = ", ".join(sorted(loras)) or "none"
        raise RequestError(
            f"LoRA adapter {params.lora_name!r} is not loaded here (loaded: {loaded})",
            param="model",
        )
    if params.priority and config.scheduler.scheduling_policy != "priority":
        raise RequestError(
            f"'priority' is {params.priority}, but this engine schedules first come, first"
            " served (start it with --scheduling-policy priority)",
            param="priority",
        )
    allowed = params.allowed_token_ids
    if allowed is not None and params.min_tokens:
        ends = {*eos_token_ids, *params.stop_token_ids}
        if ends.issuperset(allowed):
            raise RequestError(
                "'allowed_token_ids' holds only end-of-sequence and stop ids, which "
                "'min_tokens' masks: nothing could be sampled",
                param="allowed_token_ids",
            )
