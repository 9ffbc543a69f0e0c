"""The OpenAI-compatible HTTP API: ``create_app(backend, tokenizer, settings) -> FastAPI``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``
and vLLM's ``POST /classify`` (``router/embeddings.py``), vLLM's ``POST /score`` and
``/rerank`` (``router/scoring.py``), ``POST /v1/responses``, ``GET /v1/models``,
``GET /health`` (the process is up), ``GET /ready`` (``backend.is_ready()``), and vLLM's
``POST /tokenize`` / ``POST /detokenize`` (``router/tokenize.py``). Other routes
(``/metrics``, ``/admin/*``) are added by the caller with ``app.include_router``; admin
routers should depend on ``errors.require_admin_token(settings)``. Add middleware as pure
ASGI middleware (not ``@app.middleware("http")``), so client disconnects still reach the
streaming responses and abort generation. Before a handler runs, ``http_guards`` checks the
API key and the JSON content type (every path but the probes) and
``errors.BodyLimitMiddleware`` reads the body within its size and time limits.

A request is validated and tokenized here (long inputs off the event loop: ``text_workers``),
then fans out into one ``Backend.generate`` call per choice (``n`` times per prompt), with
request ids ``{response id}-{choice index}``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.protocol.sampling_params import StructuredOutput
from kvrelay.router.api_settings import ApiSettings
from kvrelay.router.backend import Backend, Delta, GenerateInput
from kvrelay.router.chat_builder import ChatBuilder
from kvrelay.router.errors import (
    ApiError,
    BodyLimitMiddleware,
    bad_request,
    install_error_handlers,
)
from kvrelay.router.http_guards import ApiGuardMiddleware
from kvrelay.router.prompts import Prompts
from kvrelay.router.request_body import parse_request
from kvrelay.router.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    bad_words_ids,
    resolve_max_tokens,
    sampling_params,
)
from kvrelay.router.responses import CompletionBuilder, ResponseBuilder, ResponseOptions
from kvrelay.router.sse import (
    ChoiceStream,
    ClientDisconnected,
    EventStreamResponse,
    collect,
    sse_events,
    until_disconnected,
)
from kvrelay.router.structured import plan_tools, resolve_structured
from kvrelay.router.text_workers import TextWorkers
from kvrelay.router.token_strings import TokenStrings
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.text.tool_parsers import ToolParser, create_tool_parser, detect_tool_parser

logger = logging.getLogger(__name__)

# an SSE body from the first delta, the choices' stream and the builder (``sse.sse_events``)
EventsFn = Callable[[tuple[int, Delta], ChoiceStream, Any], AsyncIterator[bytes]]
_CHAT_PARAM_NAMES = {"logprobs": "top_logprobs"}


class ChoiceSpec(NamedTuple):
    """How a request's choices are generated, beyond its sampling fields."""

    max_tokens: int | None  # as requested
    max_tokens_param: str  # the request field max_tokens came from
    prompt_param: str  # the request field of the prompt
    default_max_tokens: int | None  # when not requested; None = up to the context window
    logprobs: int | None  # SamplingParams.logprobs
    param_names: dict[str, str]  # SamplingParams field -> request field, where they differ
    structured: StructuredOutput | None = None  # the grammar every choice must match
    prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs (completions' echo)


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    settings: ApiSettings | None = None,
    text: TextWorkers | None = None,
) -> FastAPI:
    """The FastAPI app serving ``backend``; extend it with ``app.include_router``.

    ``text``: where long inputs are tokenized (default: threads of this process).
    """
    settings = settings or ApiSettings()
    app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_bytes,
        body_timeout=settings.body_timeout,
    )
    app.add_middleware(ApiGuardMiddleware, api_keys=settings.api_keys)  # outermost: first
    api = OpenAIApi(backend, tokenizer, settings, text or TextWorkers(tokenizer))
    app.state.openai_api = api
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/ready", api.ready, methods=["GET"])
    from kvrelay.router.tokenize import add_tokenize_routes  # it imports this module

    add_tokenize_routes(app, api)
    from kvrelay.router.responses_api import add_responses_routes

    add_responses_routes(app, api)
    from kvrelay.router.embeddings import add_embedding_routes

    add_embedding_routes(app, api)
    from kvrelay.router.scoring import add_scoring_routes

    add_scoring_routes(app, api)
    return app


@dataclass(slots=True)
class OpenAIApi:
    """Request handlers; one instance per app."""

    backend: Backend
    tokenizer: Tokenizer
    settings: ApiSettings
    text: TextWorkers
    tokens: TokenStrings = field(init=False)
    model_names: tuple[str, ...] = field(init=False)
    created: int = field(init=False)
    tool_parser: ToolParser | None = field(init=False)
    prompts: Prompts = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = TokenStrings(self.tokenizer)
        name = self.settings.tool_call_parser
        if name == "auto":
            name = detect_tool_parser(self.tokenizer.chat_template)
        self.tool_parser = create_tool_parser(name) if name else None
        self.prompts = Prompts(self.tokenizer, self.text, self.backend, self.tool_parser)
        self.model_names = self.settings.served_model_names or (self.backend.model_name,)
        self.created = int(time.time())

    # ---- operations

    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        if self.backend.is_ready():
            return JSONResponse({"status": "ready"})
        error = ApiError(503, "not ready", type="server_error", code="not_ready")
        error.headers["Retry-After"] = "1"
        return error.to_response()

    async def models(self) -> Response:
        base = self.model_names[0]
        data = [self._model_card(name, self.backend.model_name, None) for name in self.model_names]
        # a LoRA adapter: its own root, the base model as its parent
        data += [self._model_card(name, name, base) for name in self._adapters()]
        return JSONResponse({"object": "list", "data": data})

    def _model_card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvrelay",
            "root": root,
            "parent": parent,
            "max_model_len": self.backend.max_model_len,
        }

    def _adapters(self) -> list[str]:
        """The backend's LoRA adapters that no served name hides (a name of the base wins)."""
        return [n for n in self.backend.lora_adapters() if n not in self.model_names]

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` (checked by ``model_name``) names; None:
        the base model."""
        return None if model is None or model in self.model_names else model

    # ---- generation

    async def completions(self, request: Request) -> Response:
        req = parse_request(await request.body(), CompletionRequest)
        model = self.model_name(req.model)
        n = self.settings.check_n(req.n, len(req.prompt))
        self.settings.check_completion_options(req, n)
        keep = self.prompts.tokens_kept(req.truncate_prompt_tokens)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        prompts = [
            await self.prompts.completion(p, req.echo, add_special, keep) for p in req.prompt
        ]
        options = ResponseOptions(
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            want_logprobs=req.logprobs is not None,
            echo=req.echo,
            tokens_as_ids=req.return_tokens_as_token_ids,
            num_logprobs=req.logprobs or 0,
            prompt_logprobs=req.prompt_logprobs is not None,
            prompt_only=req.echo and req.max_tokens == 0,
        )
        builder = CompletionBuilder(model, prompts, n, self.tokens, options)
        spec = ChoiceSpec(
            # echo with max_tokens 0 scores the prompt alone: the engine makes one token,
            # which the builder drops (``ResponseOptions.prompt_only``)
            max_tokens=1 if options.prompt_only else req.max_tokens,
            max_tokens_param="max_tokens",
            prompt_param="prompt",
            default_max_tokens=self.settings.default_max_tokens,
            logprobs=req.logprobs,
            param_names={"prompt_logprobs": "logprobs"},
            structured=resolve_structured(req.response_format, req.structured_outputs, req.guided),
            # echo with logprobs: the prompt's tokens get theirs too, as OpenAI's legacy
            # completions gave them (what lm-evaluation-harness reads for loglikelihoods)
            prompt_logprobs=_prompt_logprobs(req.prompt_logprobs, req.logprobs, req.echo),
        )
        inputs = self._inputs(builder, req, n, spec)
        return await self.respond(request, builder, inputs, req.stream)

    async def chat_completions(self, request: Request) -> Response:
        req = parse_request(await request.body(), ChatCompletionRequest)
        builder, inputs = await self.prepare_chat(req)
        return await self.respond(request, builder, inputs, req.stream)

    async def prepare_chat(
        self, req: ChatCompletionRequest, builder_type: type[ChatBuilder] = ChatBuilder
    ) -> tuple[ChatBuilder, list[GenerateInput]]:
        """A validated chat request's builder (of ``builder_type``) and its choices' inputs."""
        model = self.model_name(req.model)
        n = self.settings.check_n(req.n, 1)
        self.settings.check_chat_options(req)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        structured = resolve_structured(req.response_format, req.structured_outputs, req.guided)
        if tools.structured is not None:
            if structured is not None:
                raise bad_request(
                    f"'tool_choice' {tools.mode!r} cannot be combined with a response format",
                    "response_format",
                )
            structured = tools.structured
        prompt = await self.prompts.chat(req, tools)
        options = ResponseOptions(
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            want_logprobs=req.logprobs,
            tokens_as_ids=req.return_tokens_as_token_ids,
            prompt_logprobs=req.prompt_logprobs is not None,
        )
        builder = builder_type(model, [prompt], n, self.tokens, options, tools)
        return builder, self._inputs(builder, req, n, _chat_spec(req, structured))

    # ---- the model asked for

    def model_name(self, requested: str | None) -> str:
        """The model a request asks for: a served name of the base model, or a LoRA adapter
        some worker holds; 404 for any other."""
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names and requested not in self.backend.lora_adapters():
            shown = requested if len(requested) <= 100 else f"{requested[:100]}..."
            served = ", ".join((*self.model_names, *self._adapters()))
            raise ApiError(
                404,
                f"The model '{shown}' does not exist. Served: {served}",
                param="model",
                code="model_not_found",
            )
        return requested

    # ---- prompts

    def _inputs(
        self,
        builder: ResponseBuilder,
        req: CompletionRequest | ChatCompletionRequest,
        n: int,
        spec: ChoiceSpec,
    ) -> list[GenerateInput]:
        """One GenerateInput per choice (seeds ``seed + i`` so the n choices differ)."""
        limit = self.settings.max_tokens_limit
        bad_words = () if not req.bad_words else bad_words_ids(self._encode_word, req.bad_words)
        inputs = []
        for choice in builder.choices:
            prompt = builder.prompts[choice.prompt_index]
            max_tokens = resolve_max_tokens(
                spec.max_tokens,
                spec.max_tokens_param,
                spec.prompt_param,
                len(prompt.token_ids),
                self.backend.max_model_len,
                spec.default_max_tokens,
            )
            params = sampling_params(
                req,
                max_tokens if limit is None else min(max_tokens, limit),
                spec.logprobs,
                spec.param_names,
                seed_offset=choice.index % n,
                structured=spec.structured,
                prompt_logprobs=spec.prompt_logprobs,
                bad_words_token_ids=bad_words,
                lora_name=self.lora_name(req.model),
            )
            error = params.vocab_error(self.tokenizer.vocab_size)  # logit_bias, allowed ids
            if error is not None:
                raise bad_request(error[1], error[0])
            inputs.append(GenerateInput(builder.request_id(choice.index), prompt.token_ids, params))
        return inputs

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    # ---- responses

    async def respond(
        self,
        request: Request,
        builder: ResponseBuilder,
        inputs: list[GenerateInput],
        stream: bool,
        events: EventsFn = sse_events,
    ) -> Response:
        """Runs the choices; returns the JSON body, or an SSE stream (``events`` of the first
        delta, the rest and the builder) once the first delta came.

        Errors before the first delta (``Overloaded``...) are real HTTP errors; later ones
        become an SSE error event.
        """
        choices = ChoiceStream(self.backend, inputs)
        handed_off = False
        try:
            if not stream:
                await until_disconnected(request, collect(choices, builder))
                return _json(builder.response())
            first = await until_disconnected(request, choices.next())
            assert first is not None  # every request has at least one choice
            body = events(first, choices, builder)
            handed_off = True
            return EventStreamResponse(body, choices.close)
        except ClientDisconnected:
            logger.info("client disconnected before %s was ready; aborted", builder.id)
            return Response(status_code=499)
        finally:
            if not handed_off:
                choices.close()


def _chat_spec(req: ChatCompletionRequest, structured: StructuredOutput | None) -> ChoiceSpec:
    """Chat names the length ``max_completion_tokens`` (``max_tokens`` is the old name)."""
    max_tokens: int | None = req.max_tokens
    param = "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return ChoiceSpec(
        max_tokens=max_tokens,
        max_tokens_param=param,
        prompt_param="messages",
        default_max_tokens=None,
        logprobs=logprobs,
        param_names={**_CHAT_PARAM_NAMES, "max_tokens": param},
        structured=structured,
        prompt_logprobs=req.prompt_logprobs,
    )


def _prompt_logprobs(asked: int | None, logprobs: int | None, echo: bool) -> int | None:
    """SamplingParams.prompt_logprobs of a completion: vLLM's field, or echo's logprobs (the
    larger when both: each shows its own top)."""
    echoed = logprobs if echo else None
    if asked is None or echoed is None:
        return asked if echoed is None else echoed
    return max(asked, echoed)


def _json(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json")
