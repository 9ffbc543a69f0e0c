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


class EmbeddingRequest(_Strict):
    """OpenAI's request, or vLLM's chat form: ``messages`` instead of ``input``."""

    model: str | None = None
    input: Annotated[Prompt | None, PlainValidator(_check_prompt)] = None
    messages: list[ChatMessage] | None = None  # vLLM: one input, through the chat template
    add_generation_prompt: bool = False  # with messages (vLLM's default for embeddings)
    continue_final_message: bool = False  # with messages
    chat_template: str | None = None  # with messages: needs the router's trust flag
    chat_template_kwargs: dict[str, Any] | None = None  # with messages
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, unused (OpenAI's end-user id)
    truncate_prompt_tokens: int | None = None  # vLLM: keep each input's last N tokens
    # vLLM: the tokenizer's BOS (and such) around text; None: true for input, false for
    # messages (whose template writes its own)
    add_special_tokens: bool | None = None
    use_activation: bool | None = None  # vLLM: unit L2 norm; None is the model's setting
    normalize: bool | None = None  # vLLM's older name of use_activation
    cache_salt: str | None = None  # as for completions: only requests with it share blocks
    priority: int = 0  # as for completions (workers scheduling by priority)


def add_embedding_routes(app: FastAPI, api: OpenAIApi) -> None:
    """Adds ``/v1/embeddings`` to ``app``, served through ``api``'s backend."""
    app.add_api_route("/v1/embeddings", EmbeddingRoutes(api).embeddings, methods=["POST"])


@dataclass(slots=True)
class EmbeddingRoutes:
    api: OpenAIApi

    async def embeddings(self, request: Request) -> Response:
        req = parse_request(await request.body(), EmbeddingRequest)
        model = self.api.model_name(req.model)
        if req.dimensions is not None and not 1 <= req.dimensions <= MAX_DIMENSIONS:
            raise bad_request(f"'dimensions' must be >= 1, got {req.dimensions}", "dimensions")
        prompts = await self._prompts(req)
        flags = {req.use_activation, req.normalize} - {None}
        if len(flags) > 1:
            raise bad_request("'use_activation' and 'normalize' disagree", "use_activation")
        pooling = PoolingParams(req.dimensions, flags.pop() if flags else None)
        try:
            lora_name = self.api.lora_name(model)
            params = SamplingParams(
                lora_name=lora_name, cache_salt=req.cache_salt, priority=req.priority
            )
        except ValueError as exc:
            raise bad_request(str(exc), _param(exc)) from None
        request_id = f"embd-{uuid.uuid4().hex}"
        inputs = [
            GenerateInput(f"{request_id}-{i}", ids, params, pooling)
            for i, ids in enumerate(prompts)
        ]
        try:
            vectors = await until_disconnected(request, self._run(inputs))
        except ClientDisconnected:
            return Response(status_code=499)
        num_tokens, fmt = sum(len(ids) for ids in prompts), req.encoding_format
        return JSONResponse(
            {
                "id": request_id,
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": [
                    {"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
                    for i, v in enumerate(vectors)
                ],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            }
        )

    async def _prompts(self, req: EmbeddingRequest) -> list[list[int]]:
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
            self.api.check_chat_options(chat)
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

    async def _run(self, inputs: list[GenerateInput]) -> list[bytes]:
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
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _param(exc: ValueError) -> str | None:
    """The request field a SamplingParams error names (``SamplingParams.cache_salt ...``)."""
    text = str(exc)
    for name in ("cache_salt", "priority"):
        if f"SamplingParams.{name}" in text:
            return name
    return None
