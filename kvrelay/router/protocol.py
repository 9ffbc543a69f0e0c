"""Wire format of ``/v1/completions`` and ``/v1/chat/completions``: requests in, bodies out.

The two decisions live apart: ``request_models`` says which request bodies are valid and what
they ask of the engine; ``responses`` says how each choice's deltas become OpenAI bodies,
stream chunks, usage and logprobs. This module is their one import point.
"""

from __future__ import annotations

from kvrelay.router.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Prompt,
    StreamOptions,
    TextPart,
    context_length_error,
    resolve_max_tokens,
    sampling_params,
)
from kvrelay.router.responses import (
    MIN_LOGPROB,
    ChatBuilder,
    ChoiceState,
    CompletionBuilder,
    PromptInfo,
    ResponseBuilder,
    ResponseOptions,
    TokenStrings,
    make_usage,
)

__all__ = [
    "MIN_LOGPROB",
    "ChatBuilder",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceState",
    "CompletionBuilder",
    "CompletionRequest",
    "Prompt",
    "PromptInfo",
    "ResponseBuilder",
    "ResponseOptions",
    "StreamOptions",
    "TextPart",
    "TokenStrings",
    "context_length_error",
    "make_usage",
    "resolve_max_tokens",
    "sampling_params",
]
