"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in its request and response shapes.

``/tokenize`` takes ``{model, prompt}`` (a string; ``add_special_tokens`` defaults to true) or
``{model, messages}`` (rendered with the chat template exactly as ``/v1/chat/completions``
renders them; ``add_special_tokens`` defaults to false) and answers ``{count, max_model_len,
tokens}`` (plus ``token_strs`` when ``return_token_strs`` is true). ``/detokenize`` takes
``{model, tokens}`` and answers ``{prompt}``. Both run in the router (no worker is involved),
so the ids are those the generation endpoints would send to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.router.api import OpenAIApi
from kvrelay.router.errors import bad_request
from kvrelay.router.request_body import parse_request
from kvrelay.router.request_models import ChatCompletionRequest, ChatMessage, _Strict


class TokenizeRequest(_Strict):
    """Either ``prompt`` or ``messages``, never both (vLLM's two tokenize request kinds)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as the chat endpoint: needs the router's trust flag
    tools: list[Any] | None = None  # rendered as the chat endpoint renders them
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, api: OpenAIApi) -> None:
    """Adds ``/tokenize`` and ``/detokenize`` to ``app``, served with ``api``'s tokenizer."""
    routes = TokenizeRoutes(api)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])


@dataclass(slots=True)
class TokenizeRoutes:
    api: OpenAIApi

    async def tokenize(self, request: Request) -> Response:
        req = parse_request(await request.body(), TokenizeRequest)
        self.api.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await self.api.prompts.encode(req.prompt, add_special, "prompt")
        else:
            tokens = await self._chat_tokens(req)
        body: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.api.backend.max_model_len,
            "tokens": tokens,
        }
        if req.return_token_strs:
            body["token_strs"] = self.api.tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        req = parse_request(await request.body(), DetokenizeRequest)
        self.api.model_name(req.model)
        vocab_size = self.api.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens"
            )
        return JSONResponse({"prompt": self.api.tokenizer.decode(req.tokens, False)})

    async def _chat_tokens(self, req: TokenizeRequest) -> list[int]:
        chat = ChatCompletionRequest(
            messages=req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            chat_template=req.chat_template,
            tools=req.tools,
            tool_choice="none" if req.tools else None,  # rendered alike; no parser needed
        )
        self.api.settings.check_chat_options(chat)
        prompt = await self.api.prompts.chat(chat)
        if req.add_special_tokens:  # the chat endpoint encodes the rendered text without them
            return await self.api.prompts.encode(prompt.text, True, "messages")
        return prompt.token_ids
