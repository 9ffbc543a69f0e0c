"""The HTTP API's limits and names (``ApiSettings``), validated once, and the checks that hold
a request to them: what a completion or chat request may ask for before anything is tokenized
(each failure an OpenAI-shaped 400 naming the field)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.protocol.pooling import ClassifierConfig
from kvrelay.protocol.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS
from kvrelay.router.errors import bad_request
from kvrelay.router.request_models import ChatCompletionRequest, CompletionRequest
from kvrelay.text.tool_parsers import create_tool_parser

# what a request's chat_template_kwargs may not set: the template's own arguments
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"self", "messages", "add_generation_prompt", "tools", "chat_template"}
)


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """Limits and names of the HTTP API; validated once. Its ``check_*`` methods hold a
    request to the limits."""

    served_model_names: tuple[str, ...] = ()  # names clients may ask for; () = backend's name
    max_body_bytes: int = 4 << 20  # larger request bodies get 413 before parsing
    admin_token: str | None = None  # bearer token of /admin/* routes; None = no check
    max_n: int = 16  # choices per prompt (n)
    max_batch_prompts: int = 32  # prompts in one /v1/completions request
    max_embedding_inputs: int = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
    max_choices: int = 64  # prompts x n per request
    max_stop_strings: int = MAX_STOP_STRINGS  # stop strings per request
    max_logprobs: int = MAX_LOGPROBS  # logprobs (completions) / top_logprobs (chat)
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    max_tokens_limit: int | None = None  # clamps every request's max_tokens; None = no cap
    api_keys: tuple[str, ...] = ()  # bearer keys accepted (all but the probes); () = no check
    body_timeout: float = 30.0  # seconds to receive a request body before 408
    tool_call_parser: str | None = "auto"  # tool_choice "auto": a parser name; "auto" detects
    # it from the chat template; None: no parser ("auto" tool choice answers 400)
    trust_request_chat_template: bool = False  # apply a request's `chat_template` (else 400)
    # the served model's head when it is a sequence classifier (its config.json): /classify,
    # and /score and /rerank as a cross-encoder; None: a generative or embedding model
    classifier: ClassifierConfig | None = None

    def __post_init__(self) -> None:
        if any(not name for name in self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty, got {self.served_model_names}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.admin_token == "":
            raise ValueError("admin_token must be None or non-empty")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0, got {self.body_timeout}")
        _check_range("max_n", self.max_n, MAX_N)
        _check_range("max_batch_prompts", self.max_batch_prompts, 1 << 16)
        _check_range("max_embedding_inputs", self.max_embedding_inputs, 1 << 16)
        _check_range("max_choices", self.max_choices, 1 << 16)
        _check_range("max_stop_strings", self.max_stop_strings, MAX_STOP_STRINGS, low=0)
        _check_range("max_logprobs", self.max_logprobs, MAX_LOGPROBS, low=0)
        _check_range("default_max_tokens", self.default_max_tokens, 1 << 31)
        if self.max_tokens_limit is not None:
            _check_range("max_tokens_limit", self.max_tokens_limit, 1 << 31)
        if self.tool_call_parser not in (None, "auto"):
            create_tool_parser(self.tool_call_parser)  # ValueError naming the choices

    # ---- a request held to them (each raises an OpenAI-shaped 400 naming the field)

    def check_n(self, n: int | None, num_prompts: int) -> int:
        """``n`` (None: 1) within ``max_n``, and the prompts and choices within theirs."""
        n = 1 if n is None else n
        if not 1 <= n <= self.max_n:
            raise bad_request(f"'n' must be in [1, {self.max_n}], got {n}", "n")
        if num_prompts > self.max_batch_prompts:
            raise bad_request(
                f"at most {self.max_batch_prompts} prompts per request, got {num_prompts}",
                "prompt",
            )
        if n * num_prompts > self.max_choices:
            raise bad_request(
                f"prompts x n must be at most {self.max_choices}, got {num_prompts} x {n}",
                "n",
            )
        return n

    def _check_stop(self, stop: str | list[str] | None) -> None:
        num_stop = 0 if stop is None else 1 if isinstance(stop, str) else len(stop)
        if num_stop > self.max_stop_strings:
            raise bad_request(
                f"at most {self.max_stop_strings} stop strings, got {num_stop}", "stop"
            )

    def _check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise bad_request(f"'{param}' must be in [0, {self.max_logprobs}], got {value}", param)

    def _check_prompt_logprobs(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request(
                "'prompt_logprobs' is not supported when streaming (a completion's 'echo' with "
                "'logprobs' streams the prompt's logprobs in its first chunk)",
                "prompt_logprobs",
            )

    def check_completion_options(self, req: CompletionRequest, n: int) -> None:
        self._check_stop(req.stop)
        self._check_prompt_logprobs(req)
        self._check_logprobs(req.logprobs, "logprobs")
        if not req.prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        if req.suffix:
            raise bad_request("'suffix' is not supported", "suffix")
        if req.best_of is not None and req.best_of != n:
            raise bad_request("'best_of' is not supported (it must equal n)", "best_of")

    def check_chat_options(self, req: ChatCompletionRequest) -> None:
        self._check_stop(req.stop)
        self._check_prompt_logprobs(req)
        self._check_logprobs(req.top_logprobs, "top_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        if not req.messages:
            raise bad_request("'messages' must not be empty", "messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request(
                "'continue_final_message' needs 'add_generation_prompt' set to false",
                "continue_final_message",
            )
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "'chat_template' is not accepted by this deployment: a request's template runs "
                "on the router and changes what the model is told (start the router with "
                "--trust-request-chat-template to allow it)",
                "chat_template",
            )
        reserved = _RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or {})
        if reserved:
            raise bad_request(
                f"'chat_template_kwargs' may not set {sorted(reserved)}", "chat_template_kwargs"
            )


def _check_range(name: str, value: int, high: int, low: int = 1) -> None:
    if not low <= value <= high:
        raise ValueError(f"ApiSettings.{name} must be in [{low}, {high}], got {value}")
