"""Requests of ``/v1/completions`` and ``/v1/chat/completions``: what a valid body is.

Decides which request bodies are accepted and what they mean to the engine. Requests are
pydantic models in strict mode: a known field with the wrong JSON type is a 400, and ``null``
means "not set". A field the server does not know is a 400 naming it, as OpenAI answers one
(``unrecognized_field``): ignored silently, a ``logit_bias`` or a ``functions`` would change
nothing while the client trusted it. OpenAI's fields that do not change the output
(``metadata``, ``store: false``, ``service_tier``...) are accepted; those it defines that
kvrelay cannot honour (``audio``, ``prediction``, ``functions``...) get a 400 that says so.
``sampling_params`` and ``resolve_max_tokens`` turn a validated request into the
``SamplingParams`` of one choice, naming the offending field in every 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from kvrelay.protocol.sampling_params import REQUEST_NAMES, SamplingParams, StructuredOutput
from kvrelay.router.errors import ApiError, bad_request

Prompt = list[str] | list[list[int]]  # one entry per prompt of a batch


# ---- requests -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far in every chunk


class TextPart(_Strict):
    """A chat content part; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> TextPart:
        if self.type != "text":
            raise PydanticCustomError(
                "unsupported_part",
                "unsupported content part type '{kind}': only 'text' parts are supported",
                {"kind": self.type},
            )
        if self.text is None:
            raise PydanticCustomError("missing_text", "a 'text' part needs a string 'text'")
        return self


class ChatMessage(BaseModel):
    """One chat message; extra keys (``tool_calls``, ``tool_call_id``...) go to the template."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError(
                "missing_content", "a {role} message needs 'content'", {"role": self.role}
            )
        return self

    @property
    def text(self) -> str:
        """The content as the template sees it (text parts joined with newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: OpenAI's serialised tool-call
        ``arguments`` become objects (as vLLM and transformers' templates want them)."""
        message = self.model_dump(exclude_none=True)
        # an assistant turn of tool calls may come with content null: templates read
        # message.content, and a missing key fails them where an empty string does not
        message.setdefault("content", "")
        if self.role == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_call_for_template(call) for call in calls]
        return message


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _check_prompt(value: object) -> Prompt:
    """A string, token ids, or a batch of either -> a list of strings or of token-id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(_is_token_id(v) for v in value):
            return [list(value)]
        if all(isinstance(v, list) and all(_is_token_id(t) for t in v) for v in value):
            return [list(v) for v in value]
    if value == []:
        return []
    raise PydanticCustomError(
        "prompt_type",
        "must be a string, an array of token ids, or an array of strings or of token-id arrays",
    )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _GenerateRequest(_Strict):
    """Fields both endpoints share; vLLM's extensions included."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None  # accepted, ignored
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None  # vLLM's: prefix cache shared only within one salt
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs and top k
    add_special_tokens: bool | None = None  # vLLM's: bos/eos by the tokenizer (chat: False)
    bad_words: list[str] | None = None  # vLLM's: words the output must not contain
    priority: int | None = None  # vLLM's: lower runs first (--scheduling-policy priority)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last k (-1: the context)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: {json|regex|choice|grammar: ...}
    guided_json: dict[str, Any] | str | None = None  # vLLM's older spelling of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def guided(self) -> dict[str, Any]:
        """The ``guided_*`` fields that are set."""
        names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return {name: value for name in names if (value := getattr(self, name)) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``): usage in every chunk."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)


class CompletionRequest(_GenerateRequest):
    prompt: Annotated[Prompt, PlainValidator(_check_prompt)]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# ---- request -> SamplingParams ------------------------------------------------------------

_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "cache_salt",
    "allowed_token_ids",
    "priority",
)
_PARAM_NAME = re.compile(r"^SamplingParams\.(\w+) ")


def sampling_params(
    request: _GenerateRequest,
    max_tokens: int,
    logprobs: int | None,
    param_names: dict[str, str],
    seed_offset: int = 0,
    structured: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
    bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    lora_name: str | None = None,
) -> SamplingParams:
    """The ``n == 1`` params of one choice.

    Args:
        request: the validated request.
        max_tokens: the resolved length limit.
        logprobs: ``SamplingParams.logprobs``.
        param_names: SamplingParams field -> request field, where the names differ.
        seed_offset: added to the request's seed (choice ``i`` of ``n`` gets ``seed + i``).
        structured: the grammar the output must match (``structured.resolve_structured``).
        prompt_logprobs: ``SamplingParams.prompt_logprobs``.
        bad_words_token_ids: the request's ``bad_words``, tokenized (``bad_words_ids``).
        lora_name: the LoRA adapter its ``model`` names; None for the base model.

    Raises:
        ApiError: 400 naming the offending request field.
    """
    kwargs = {name: v for name in _PASSTHROUGH if (v := getattr(request, name)) is not None}
    if request.logit_bias is not None:
        kwargs["logit_bias"] = logit_bias_ids(request.logit_bias)
    if request.seed is not None:
        kwargs["seed"] = request.seed + seed_offset
    try:
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured_outputs=structured,
            prompt_logprobs=prompt_logprobs,
            bad_words_token_ids=bad_words_token_ids,
            lora_name=lora_name,
            **kwargs,
        )
    except ValueError as exc:
        message = str(exc)
        match = _PARAM_NAME.match(message)
        name = match.group(1) if match else None
        param = param_names.get(name, REQUEST_NAMES.get(name, name)) if name else None
        raise bad_request(message.replace(f"SamplingParams.{name}", f"'{param}'"), param) from exc


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """A request's ``logit_bias`` (JSON keys are strings) keyed by token id; 400 naming the
    field for a key that is not a token id."""
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            shown = key if len(key) <= 40 else f"{key[:40]}..."
            raise bad_request(
                f"'logit_bias' keys must be token ids (decimal integers), got {shown!r}",
                "logit_bias",
            )
        out[int(key)] = value
    return out


# Fields of OpenAI's requests that do not change what is generated: accepted, unused.
_NO_OP_FIELDS = frozenset(
    ("metadata", "service_tier", "safety_identifier", "prompt_cache_key",
     "prompt_cache_retention", "prompt_cache_options")
)  # fmt: skip
# Fields OpenAI defines that kvrelay cannot honour, and why.
_UNSUPPORTED_FIELDS = {
    "functions": "deprecated by OpenAI and not supported: send them as 'tools'",
    "function_call": "deprecated by OpenAI and not supported: use 'tool_choice'",
    "audio": "not supported: this server generates text only",
    "prediction": "not supported (predicted outputs)",
    "web_search_options": "not supported: this server has no web search",
    "reasoning_effort": "not supported: the served models have no reasoning mode",
    "verbosity": "not supported by the served models",
    "moderation": "not supported: this server runs no moderation",
}


def check_fields(data: dict[str, Any], model: type[BaseModel]) -> None:
    """400 for a request field ``model`` does not define and that is not a no-op of OpenAI's:
    an unsupported OpenAI field says why, any other is unrecognised (OpenAI's answer).

    ``store`` and ``modalities`` are accepted with the values that keep their meaning here:
    ``store`` false (nothing is kept) and ``modalities`` ``["text"]``."""
    for name, value in data.items():
        if name in model.model_fields or name in _NO_OP_FIELDS or value is None:
            continue
        if name == "store" and value is False:
            continue
        if name == "modalities" and value == ["text"]:
            continue
        if name == "store":
            raise bad_request(
                "'store' is not supported: this server keeps no completions (send false or "
                "leave it out)",
                "store",
            )
        if name == "modalities":
            raise bad_request("'modalities' must be [\"text\"]: this server generates text "
                              "only", "modalities")  # fmt: skip
        why = _UNSUPPORTED_FIELDS.get(name)
        shown = name if len(name) <= 60 else f"{name[:60]}..."
        if why is not None:
            raise bad_request(f"'{name}' is {why}", name)
        raise ApiError(
            400,
            f"Unrecognized request argument supplied: {shown}",
            param=shown,
            code="unrecognized_field",
        )


def resolve_max_tokens(
    requested: int | None,
    param: str,
    prompt_param: str,
    prompt_len: int,
    max_model_len: int,
    default: int | None,
) -> int:
    """The max_tokens of a request, checked against the context window.

    Args:
        requested: what the client asked for, or None.
        param: the request field it came from (for the error).
        prompt_param: the request field of the prompt (``prompt`` or ``messages``).
        prompt_len: prompt tokens.
        max_model_len: the context window (prompt + output).
        default: used when ``requested`` is None (clamped to the window); None = the window.

    Raises:
        ApiError: 400 ``context_length_exceeded`` when the prompt leaves no room, or when
            ``prompt_len + requested`` passes the window; 400 when ``requested < 1``.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise context_length_error(prompt_len, max_model_len, None, prompt_param)
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"'{param}' must be at least 1, got {requested}", param)
    if requested > room:
        raise context_length_error(prompt_len, max_model_len, requested, param)
    return requested


MAX_BAD_WORDS = 1024  # strings in a request's bad_words


def bad_words_ids(
    encode: Callable[[str], list[int]], words: list[str]
) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word as written (leading spaces dropped)
    and, where it starts another token of the same count, after a space, the form it takes
    mid-sentence. Raises a 400 naming ``bad_words`` for an empty word or too many."""
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(
            f"'bad_words' has {len(words)} words, more than {MAX_BAD_WORDS}", "bad_words"
        )
    out: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise bad_request("'bad_words' must be non-empty words", "bad_words")
        bare = tuple(encode(word.lstrip()))
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def context_length_error(
    prompt_len: int, max_model_len: int, requested: int | None, param: str
) -> ApiError:
    message = f"This model's maximum context length is {max_model_len} tokens. "
    if requested is None:
        message += f"However, your prompt has {prompt_len} tokens, leaving no room for output."
    else:
        message += (
            f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
            f"prompt, {requested} for the completion). Please reduce the prompt or '{param}'."
        )
    return ApiError(400, message, param=param, code="context_length_exceeded")
