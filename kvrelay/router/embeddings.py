"""OpenAI's ``POST /v1/embeddings``, in its request and response shapes (with vLLM's extras).

``{model, input, encoding_format, dimensions, user}``: ``input`` is a string, an array of
strings, an array of token ids or an array of such arrays (at most
``ApiSettings.max_embedding_inputs``); ``encoding_format`` ``float`` (default) or ``base64``
(float32 little-endian, which the official client asks for and decodes); ``dimensions`` keeps
the first N values, then normalizes (Matryoshka). vLLM's ``truncate_prompt_tokens``,
``add_special_tokens``, ``use_activation`` (its older name: ``normalize``), ``cache_salt``
and ``priority`` are taken too, and its chat form: ``messages`` instead of ``input`` (one
input, rendered by the chat template as ``/v1/chat/completions`` renders it, without the
generation prompt unless ``add_generation_prompt``). The answer is ``{object: "list", data:
[{object: "embedding", index, embedding}], model, usage: {prompt_tokens, total_tokens}}``.

Each input is one backend request whose ``GenerateInput.pooling`` is set: the cluster places
it on a prefill or colocated worker (cache-aware, like a prompt: an embedded document's
blocks serve a later question about it), which computes the prompt and answers with the
vector (``engine.pooling``); nothing is sampled and no KV is handed off. At most
``_CONCURRENT_INPUTS`` inputs of one request are in flight at once, so a large batch queues
inside its request rather than filling the router's admission window.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import PlainValidator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.protocol.pooling import MAX_DIMENSIONS, PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams
from kvrelay.router.api import OpenAIApi
from kvrelay.router.backend import Delta, GenerateInput, GenerationFailed
from kvrelay.router.errors import ApiError, bad_request
from kvrelay.router.request_body import parse_request
from kvrelay.router.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    Prompt,
    _check_prompt,
    _Strict,
)
from kvrelay.router.sse import ClientDisconnected, until_disconnected
from kvrelay.router.text_workers import PromptTooLong
from kvrelay.text.tokenizer import TokenizerError

_CONCURRENT_INPUTS = 64  # one request's inputs on the workers at once


class PooledInputRequest(_Strict):
    """What ``/v1/embeddings`` and ``/classify`` share: the inputs, or vLLM's chat form
    (``messages`` instead of ``input``), and the options of a pooled request."""

    model: str | None = None
    input: Annotated[Prompt | None, PlainValidator(_check_prompt)] = None
    messages: list[ChatMessage] | None = None  # vLLM: one input, through the chat template
    add_generation_prompt: bool = False  # with messages (vLLM's default for pooling)
    continue_final_message: bool = False  # with messages
    chat_template: str | None = None  # with messages: needs the router's trust flag
    chat_template_kwargs: dict[str, Any] | None = None  # with messages
    user: str | None = None  # accepted, unused (OpenAI's end-user id)
    truncate_prompt_tokens: int | None = None  # vLLM: keep each input's last N tokens
    # vLLM: the tokenizer's BOS (and such) around text; None: true for input, false for
    # messages (whose template writes its own)
    add_special_tokens: bool | None = None
    # vLLM: embeddings' unit L2 norm, a classifier's softmax / sigmoid; None: the model's
    use_activation: bool | None = None
    cache_salt: str | None = None  # as for completions: only requests with it share blocks
    priority: int = 0  # as for completions (workers scheduling by priority)


class EmbeddingRequest(PooledInputRequest):
    """OpenAI's request (with vLLM's extras)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's older name of use_activation


class ClassificationRequest(PooledInputRequest):
    """vLLM's ``/classify`` request: the inputs' scores per label."""


def add_embedding_routes(app: FastAPI, api: OpenAIApi) -> None:
    """Adds ``/v1/embeddings`` and ``/classify`` to ``app``, served through ``api``'s
    backend."""
    routes = PooledRoutes(api)
    app.add_api_route("/v1/embeddings", routes.embeddings, methods=["POST"])
    app.add_api_route("/classify", routes.classify, methods=["POST"])


@dataclass(slots=True)
class PooledRoutes:
    """Pooled requests' handlers, and what ``router/scoring.py`` builds on: ``params``,
    ``text_ids``, ``run``."""

    api: OpenAIApi

    async def embeddings(self, request: Request) -> Response:
        req = parse_request(await request.body(), EmbeddingRequest)
        model = self.api.model_name(req.model)
        classifier = self.api.settings.classifier
        if classifier is not None:
            raise bad_request(
                f"this model is a sequence classifier ({_labels(classifier.num_labels)}): it"
                " answers /classify, /score and /rerank, not embeddings",
                "model",
            )
        if req.dimensions is not None and not 1 <= req.dimensions <= MAX_DIMENSIONS:
            raise bad_request(f"'dimensions' must be >= 1, got {req.dimensions}", "dimensions")
        prompts = await self._prompts(req)
        flags = {req.use_activation, req.normalize} - {None}
        if len(flags) > 1:
            raise bad_request("'use_activation' and 'normalize' disagree", "use_activation")
        pooling = PoolingParams(req.dimensions, flags.pop() if flags else None)
        request_id = f"embd-{uuid.uuid4().hex}"
        inputs = self.inputs(request_id, prompts, self.params(model, req), pooling)
        try:
            vectors = await until_disconnected(request, self.run(inputs))
        except ClientDisconnected:
            return Response(status_code=499)
        num_tokens, fmt = sum(len(ids) for ids in prompts), req.encoding_format
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}  # OpenAI's: no more
        return list_response(request_id, model, data, usage)

    async def classify(self, request: Request) -> Response:
        """vLLM's ``/classify``: per input, every label's score (softmax, or sigmoid for
        one label; the logits with ``use_activation: false``) and the top label."""
        req = parse_request(await request.body(), ClassificationRequest)
        model = self.api.model_name(req.model)
        classifier = self.api.settings.classifier
        if classifier is None:
            raise bad_request(
                "this model is not a sequence classifier (*ForSequenceClassification):"
                " /classify needs one; /v1/embeddings and /score serve this model",
                "model",
            )
        prompts = await self._prompts(req)
        request_id = f"classify-{uuid.uuid4().hex}"
        pooling = PoolingParams(use_activation=req.use_activation)
        inputs = self.inputs(request_id, prompts, self.params(model, req), pooling)
        try:
            vectors = await until_disconnected(request, self.run(inputs))
        except ClientDisconnected:
            return Response(status_code=499)
        data = []
        for i, vector in enumerate(vectors):
            probs = floats(vector)
            top = max(range(len(probs)), key=probs.__getitem__)
            label = classifier.labels[top]
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return list_response(request_id, model, data, usage(sum(len(ids) for ids in prompts)))

    def params(self, model: str, req: Any) -> SamplingParams:
        """The sampling params a pooled request carries: its adapter, salt and priority."""
        try:
            return SamplingParams(
                lora_name=self.api.lora_name(model),
                cache_salt=req.cache_salt,
                priority=req.priority,
            )
        except ValueError as exc:
            raise bad_request(str(exc), _param(exc)) from None

    @staticmethod
    def inputs(
        request_id: str, prompts: list[list[int]], params: SamplingParams, pooling: PoolingParams
    ) -> list[GenerateInput]:
        return [
            GenerateInput(f"{request_id}-{i}", ids, params, pooling)
            for i, ids in enumerate(prompts)
        ]

    async def _prompts(self, req: PooledInputRequest) -> list[list[int]]:
        """The inputs' token ids: each of ``input``, or ``messages`` rendered as the chat
        endpoint renders them (one input)."""
        if (req.input is None) == (req.messages is None):
            raise bad_request("give exactly one of 'input' and 'messages'", "input")
        keep = self.api.prompts.tokens_kept(req.truncate_prompt_tokens)
        if req.messages is not None:
            chat = ChatCompletionRequest(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                add_special_tokens=bool(req.add_special_tokens),
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
            self.api.settings.check_chat_options(chat)
            return [(await self.api.prompts.chat(chat)).token_ids]
        limit = self.api.settings.max_embedding_inputs
        if not req.input:
            raise bad_request("'input' must not be empty", "input")
        if len(req.input) > limit:
            raise bad_request(
                f"'input' has {len(req.input)} items; at most {limit} per request", "input"
            )
        add_special = req.add_special_tokens is not False
        return [await self._tokens(item, add_special, keep) for item in req.input]

    async def _tokens(
        self, item: str | list[int], add_special: bool, keep: int | None
    ) -> list[int]:
        """One input's token ids (its last ``keep``); 400s name ``input``. An input may fill
        the whole context window: nothing is generated after it."""
        if not item:
            raise bad_request("'input' must not hold an empty string or array", "input")
        max_len = self.api.backend.max_model_len
        if isinstance(item, str):
            try:  # the child tokenizer stops counting past the window (text_workers)
                ids = await self.api.text.encode(item, add_special, None if keep else max_len + 1)
            except PromptTooLong as exc:
                raise _too_long(exc.num_tokens, max_len) from None
            except (TokenizerError, UnicodeError) as exc:
                raise bad_request(f"cannot tokenize the input: {exc}", "input") from exc
        else:
            vocab = self.api.tokenizer.vocab_size
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(
                    f"input token id {bad} is outside the vocabulary [0, {vocab})", "input"
                )
            ids = list(item)
        if keep is not None:
            return ids[-keep:]
        if len(ids) > max_len:
            raise _too_long(len(ids), max_len)
        return ids

    async def run(self, inputs: list[GenerateInput]) -> list[bytes]:
        """Every input's vector, in order; the first failure cancels the others (they abort
        on their workers)."""
        slots = asyncio.Semaphore(_CONCURRENT_INPUTS)

        async def one(item: GenerateInput) -> bytes:
            async with slots:
                last: Delta | None = None
                async for last in self.api.backend.generate(item):  # noqa: B007
                    pass
            if last is None or last.embedding is None:
                raise GenerationFailed(f"{item.request_id}: the worker sent no embedding")
            return last.embedding

        tasks = [asyncio.ensure_future(one(item)) for item in inputs]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failure, or this request cancelled (the client left)
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their aborts ran
        failed = next((t for t in tasks if not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]


def _too_long(num_tokens: int, max_len: int) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, an input has "
        f"{num_tokens} tokens. Shorten it or set 'truncate_prompt_tokens'.",
        param="input",
        code="context_length_exceeded",
    )


def _encode(vector: bytes, encoding_format: str) -> Any:
    """The wire's float32 little-endian bytes as OpenAI answers them."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return floats(vector)


def floats(vector: bytes) -> list[float]:
    """The wire's float32 little-endian bytes (``TokenEvent.embedding``) as floats."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def list_response(
    request_id: str, model: str, data: list[dict[str, Any]], usage: dict[str, int]
) -> JSONResponse:
    """The ``{id, object: "list", created, model, data, usage}`` answer of the pooled routes."""
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": usage,
        }
    )


def usage(num_tokens: int) -> dict[str, int]:
    """vLLM's usage of a pooled request: its inputs' tokens, nothing generated."""
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}


def _param(exc: ValueError) -> str | None:
    """The request field a SamplingParams error names (``SamplingParams.cache_salt ...``)."""
    text = str(exc)
    for name in ("cache_salt", "priority"):
        if f"SamplingParams.{name}" in text:
            return name
    return None


def _labels(n: int) -> str:
    return "1 label" if n == 1 else f"{n} labels"
