"""vLLM's ``POST /score`` (and ``/v1/score``) and ``POST /rerank`` (and ``/v1/rerank``,
``/v2/rerank``: the Jina and Cohere shapes), over the cluster's pooled requests.

``/score`` takes pairs in any of vLLM's four spellings (``text_1``/``text_2``,
``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``), each a string or a
list: 1:1, 1:N or N:N (``protocol.scoring.pair_indices``). It answers ``{object: "list",
data: [{index, object: "score", score}], usage}``. ``/rerank`` takes one ``query`` and its
``documents`` and answers them ranked, best first: ``{results: [{index, relevance_score,
document: {text}}], usage}``, the first ``top_n`` (0: all), without the texts when
``return_documents`` is false.

How a pair is scored depends on the model (``protocol.scoring``):

- a **cross-encoder** (a one-label sequence classifier): each pair is one input, the query's
  and the document's ids joined by the tokenizer's pair template (``Tokenizer.join_pair``),
  and the score is the head's activated logit. Every pair of a request starts with the same
  query tokens, so with the prefix cache (which shares blocks within a step too) and
  cache-aware placement the query is computed once per worker, not once per document;
- any **other model**: every text is embedded once (the query once for all documents) and a
  pair's score is the cosine of the two vectors, computed here.

``max_tokens_per_query`` and ``max_tokens_per_doc`` keep each text's first N tokens (vLLM's
meaning); ``truncate_prompt_tokens`` then caps each computed input (-1: the context window),
cutting a pair's document before its query. A pair or text still over the context window
is a 400 that names them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.protocol.pooling import PoolingParams
from kvrelay.protocol.scoring import ScoringError, cosine, cross_encodes, pair_indices
from kvrelay.router.api import OpenAIApi
from kvrelay.router.embeddings import PooledRoutes, floats, list_response, usage
from kvrelay.router.errors import ApiError, bad_request
from kvrelay.router.request_body import parse_request
from kvrelay.router.request_models import _Strict
from kvrelay.router.sse import ClientDisconnected, until_disconnected
from kvrelay.router.text_workers import PromptTooLong
from kvrelay.text.tokenizer import TokenizerError

Texts = str | list[str]
# /score's spellings of its two sides, vLLM's order: (first, second)
_PAIR_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                ("data_1", "data_2"))  # fmt: skip


class _ScoringOptions(_Strict):
    model: str | None = None
    user: str | None = None  # accepted, unused (an end-user id)
    use_activation: bool | None = None  # a cross-encoder's sigmoid; None: the model's
    max_tokens_per_query: int = Field(default=0, ge=0)  # keep the first N; 0: all
    max_tokens_per_doc: int = Field(default=0, ge=0)  # keep the first N; 0: all
    # each computed input at most N tokens (-1: the context window): a pair loses its
    # document's end first, then its query's; an embedded text its end (vLLM's bench
    # client sends -1)
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None  # as for completions: only requests with it share blocks
    priority: int = 0  # as for completions (workers scheduling by priority)


class ScoreRequest(_ScoringOptions):
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """The two sides, each (its field name, its texts); 400 unless exactly one of the
        spellings is given, whole."""
        given = {name for pair in _PAIR_FIELDS for name in pair if getattr(self, name) is not None}
        for first, second in _PAIR_FIELDS:
            if given == {first, second}:
                return (first, _as_list(getattr(self, first))), (
                    second,
                    _as_list(getattr(self, second)),
                )
        spellings = ", ".join(f"{a}/{b}" for a, b in _PAIR_FIELDS)
        raise bad_request(
            f"give the two sides as exactly one of {spellings}; got"
            f" {', '.join(sorted(given)) or 'none'}",
            sorted(given)[0] if given else "text_1",
        )


class RerankRequest(_ScoringOptions):
    query: str
    documents: Texts
    top_n: int = Field(default=0, ge=0)  # the best N; 0: all
    return_documents: bool = True  # Jina's: each result carries its text


def add_scoring_routes(app: FastAPI, api: OpenAIApi) -> None:
    routes = ScoringRoutes(PooledRoutes(api))
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, routes.score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, routes.rerank, methods=["POST"])


@dataclass(slots=True)
class ScoringRoutes:
    pooled: PooledRoutes

    @property
    def api(self) -> OpenAIApi:
        return self.pooled.api

    async def score(self, request: Request) -> Response:
        req = parse_request(await request.body(), ScoreRequest)
        model = self.api.model_name(req.model)
        (_, queries), (second, documents) = req.sides()
        request_id = f"score-{uuid.uuid4().hex}"
        try:
            scored = await until_disconnected(
                request, self._scores(request_id, model, req, queries, documents, second)
            )
        except ClientDisconnected:
            return Response(status_code=499)
        scores, num_tokens = scored
        data = [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores)]
        return list_response(request_id, model, data, usage(num_tokens))

    async def rerank(self, request: Request) -> Response:
        req = parse_request(await request.body(), RerankRequest)
        model = self.api.model_name(req.model)
        documents = _as_list(req.documents)
        request_id = f"rerank-{uuid.uuid4().hex}"
        try:
            scored = await until_disconnected(
                request, self._scores(request_id, model, req, [req.query], documents, "documents")
            )
        except ClientDisconnected:
            return Response(status_code=499)
        scores, num_tokens = scored
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])
        if req.top_n:
            ranked = ranked[: req.top_n]
        results: list[dict[str, Any]] = []
        for i in ranked:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return JSONResponse(
            {
                "id": request_id,
                "model": model,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                "results": results,
            }
        )

    async def _scores(
        self,
        request_id: str,
        model: str,
        req: _ScoringOptions,
        queries: list[str],
        documents: list[str],
        second: str,
    ) -> tuple[list[float], int]:
        """Every pair's score, in ``pair_indices`` order, and the tokens computed."""
        try:
            pairs = pair_indices(len(queries), len(documents))
        except ScoringError as exc:
            raise bad_request(str(exc), second) from None
        limit = self.api.settings.max_embedding_inputs
        if len(pairs) > limit:
            raise bad_request(f"{len(pairs)} pairs; at most {limit} per request", second)
        classifier = self.api.settings.classifier
        try:
            cross = cross_encodes(classifier)
        except ScoringError as exc:
            raise bad_request(str(exc), "model") from None
        params = self.pooled.params(model, req)
        cap = self.api.prompts.tokens_kept(req.truncate_prompt_tokens)
        # a cross-encoder's pair template adds the specials around both texts
        add_special = not cross
        per_query, per_doc = (
            _tighter(req.max_tokens_per_query, cap),
            _tighter(req.max_tokens_per_doc, cap),
        )
        firsts = [await self._ids(q, per_query, add_special, "query") for q in queries]
        seconds = [await self._ids(d, per_doc, add_special, second) for d in documents]
        if cross:
            assert classifier is not None, "a cross-encoder is a classifier"
            prompts = await self._pair_ids(
                firsts, seconds, pairs, classifier.pair_separator, second, cap
            )
            pooling = PoolingParams(use_activation=req.use_activation)
            inputs = self.pooled.inputs(request_id, prompts, params, pooling)
            vectors = await self.pooled.run(inputs)
            return [floats(v)[0] for v in vectors], sum(len(ids) for ids in prompts)
        n = len(queries)
        prompts = firsts + seconds
        inputs = self.pooled.inputs(request_id, prompts, params, PoolingParams())
        embedded = [np.frombuffer(v, dtype="<f4") for v in await self.pooled.run(inputs)]
        scores = [cosine(embedded[i], embedded[n + j]) for i, j in pairs]
        return scores, sum(len(ids) for ids in prompts)

    async def _pair_ids(
        self,
        firsts: list[list[int]],
        seconds: list[list[int]],
        pairs: list[tuple[int, int]],
        separator: bool,
        second: str,
        cap: int | None,
    ) -> list[list[int]]:
        """A cross-encoder's inputs from the texts' ids (no specials): each pair's ids (at
        most ``cap``: the document's end cut first, then the query's), within the context
        window."""
        tokenizer = self.api.tokenizer
        max_len = self.api.backend.max_model_len
        out = []
        num_special = len(tokenizer.join_pair([], [])) if separator else 0
        for i, j in pairs:
            first, rest = firsts[i], seconds[j]
            if cap is not None and len(first) + len(rest) + num_special > cap:
                room = max(0, cap - num_special)
                rest = rest[: max(0, room - len(first))]
                first = first[:room]
            if separator:
                ids = tokenizer.join_pair(first, rest)
            else:  # one text: the two (each within its limit) concatenated, then tokenized
                text = tokenizer.decode(first, False) + tokenizer.decode(rest, False)
                ids = await self._ids(text, cap or 0, True, second)
            if len(ids) > max_len:
                raise _too_long(len(ids), max_len, second)
            out.append(ids)
        return out

    async def _ids(self, text: str, keep: int, add_special: bool, param: str) -> list[int]:
        """One text's ids (its first ``keep``, when set), within the context window."""
        max_len = self.api.backend.max_model_len
        if not text:
            raise bad_request(f"'{param}' must not hold an empty string", param)
        try:  # the child tokenizer stops counting past the window (text_workers)
            ids = await self.api.text.encode(text, add_special, None if keep else max_len + 1)
        except PromptTooLong as exc:
            raise _too_long(exc.num_tokens, max_len, param) from None
        except (TokenizerError, UnicodeError) as exc:
            raise bad_request(f"cannot tokenize '{param}': {exc}", param) from exc
        if keep:
            ids = ids[:keep]
        if len(ids) > max_len:
            raise _too_long(len(ids), max_len, param)
        return ids


def _tighter(limit: int, cap: int | None) -> int:
    """The smaller of two token limits, where 0 and None mean none (0: none at all)."""
    return min(limit or cap or 0, cap or limit)


def _as_list(texts: Texts) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def _too_long(num_tokens: int, max_len: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, an input has"
        f" {num_tokens} tokens. Shorten it, or set 'max_tokens_per_query' /"
        " 'max_tokens_per_doc'.",
        param=param,
        code="context_length_exceeded",
    )
