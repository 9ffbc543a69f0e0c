"""Offline API shaped like vLLM's ``LLM``: batch in, one output per prompt out."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from kvrelay.engine.admission import RequestError
from kvrelay.engine.engine import LLMEngine
from kvrelay.engine.lora import LoRARequest
from kvrelay.engine.outputs import RequestOutput
from kvrelay.protocol.pooling import PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams, TokenLogprobs
from kvrelay.protocol.scoring import cosine, cross_encodes, pair_indices
from kvrelay.text.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]
OutputT = TypeVar("OutputT")  # a pooled output's kind
Message = dict[str, Any]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs | None] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class GenerateOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs set: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class PoolingRequestOutput(Generic[OutputT]):
    """One pooled prompt's result (vLLM's shape): ``outputs`` an ``EmbeddingOutput``,
    ``ClassificationOutput`` or ``ScoringOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: OutputT
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """``LLM.embed``'s result for one prompt (``out.outputs.embedding``)."""

    __slots__ = ()


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one per label: activated (softmax or sigmoid) unless asked not

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """``LLM.classify``'s result for one prompt (``out.outputs.probs``)."""

    __slots__ = ()


@dataclass(slots=True)
class ScoringOutput:
    score: float


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """``LLM.score``'s result for one pair (``out.outputs.score``); the token ids are the
    pair's input (a cross-encoder) or the two texts' (an embedding model)."""

    __slots__ = ()


class LLM:
    """Runs a model in this process.

    Args:
        model: checkpoint directory (Hugging Face format).
        dtype: "float32" or "bfloat16" (or "float16").
        seed: seed for requests that do not set their own.
        skip_tokenizer_init: run without a tokenizer (token-id prompts only, no text).
        warm_up: run throwaway requests through every kind of step before returning
            (``LLMEngine.warm_up``, as a serving worker on a GPU does), so that the first
            ``generate`` does not pay one-time kernel and allocator set-up; nothing of them
            remains.
        **engine_args: ``block_size``, ``num_blocks``, ``kv_cache_memory_bytes``,
            ``enable_prefix_caching``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``, ``num_threads``, ``scheduling_policy``, ``lora_modules``
            (``(name, path)`` pairs loaded at start), ``speculative_config`` (vLLM's dict:
            ``{"method": "ngram", "num_speculative_tokens": 3, ...}``,
            ``engine.spec_decode``), ``pooler_config`` (vLLM's dict, ``{"pooling_type":
            "MEAN", "normalize": false}``: how ``embed`` pools, ``protocol.pooling``).
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str = "float32",
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        warm_up: bool = True,
        **engine_args: Any,
    ) -> None:
        self.engine = LLMEngine.from_args(
            model, dtype=dtype, seed=seed, skip_tokenizer_init=skip_tokenizer_init, **engine_args
        )
        if warm_up:
            self.engine.warm_up()
        # offline use wants every step fast from the first: wait for a background packing of
        # the CPU weights (kernels.cpu_packed; a serving worker starts without waiting)
        self.engine.runner.model.wait_packed()
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise RequestError("this LLM was started with skip_tokenizer_init=True")
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[GenerateOutput]:
        """Generates for every prompt (a string, token ids, or ``{"prompt_token_ids": ...}``),
        through the LoRA adapter of ``lora_request`` (one for all prompts, or one per
        prompt; None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        params_list = self._with_lora(params_list, lora_request)
        requests = [self._encode(p) for p in prompt_list]
        return self._run(requests, params_list)

    def embed(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``engine.pooling``): the model's pooling of the prompt's
        final hidden states (``pooler_config``: the last token's unless the checkpoint or
        the setting says otherwise), normalized unless a ``PoolingParams`` says not."""
        if self.engine.config.model_config.classifier is not None:
            raise RequestError(
                "this model is a classifier: it answers LLM.classify and LLM.score, not embed",
                param="model",
            )
        return [
            EmbeddingRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                EmbeddingOutput(_vector(out).tolist()),
                num_cached_tokens=out.num_cached_tokens,
            )
            for out in self._pool(prompts, pooling_params, lora_request)
        ]

    def classify(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """One score per label for every prompt, from a sequence classifier's head
        (``*ForSequenceClassification``): its softmax (a sigmoid for one label or
        independent labels), or the logits with ``PoolingParams(use_activation=False)``."""
        self._classifier("LLM.classify")
        return [
            ClassificationRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                ClassificationOutput(_vector(out).tolist()),
                num_cached_tokens=out.num_cached_tokens,
            )
            for out in self._pool(prompts, pooling_params, lora_request)
        ]

    def score(
        self,
        data_1: str | Seq[str],
        data_2: str | Seq[str],
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """The score of each (query, document) pair, 1:1, 1:N or N:N (``protocol.scoring``):
        a cross-encoder's activated logit over the pair joined by the tokenizer's pair
        template, or the cosine of an embedding model's two vectors."""
        queries = [data_1] if isinstance(data_1, str) else list(data_1)
        documents = [data_2] if isinstance(data_2, str) else list(data_2)
        pairs = pair_indices(len(queries), len(documents))
        mc = self.engine.config.model_config
        tokenizer = self.get_tokenizer()
        if cross_encodes(mc.classifier, mc.architecture):
            inputs = [self._pair_ids(queries[i], documents[j]) for i, j in pairs]
            outs = self._pool(inputs, pooling_params, lora_request)
            return [
                ScoringRequestOutput(
                    out.request_id,
                    out.prompt_token_ids,
                    ScoringOutput(float(_vector(out)[0])),
                    num_cached_tokens=out.num_cached_tokens,
                )
                for out in outs
            ]
        texts = queries + documents
        outs = self._pool([tokenizer.encode(t) for t in texts], pooling_params, lora_request)
        vectors = [_vector(out).numpy() for out in outs]
        return [
            ScoringRequestOutput(
                f"{outs[i].request_id}_{outs[len(queries) + j].request_id}",
                outs[i].prompt_token_ids + outs[len(queries) + j].prompt_token_ids,
                ScoringOutput(cosine(vectors[i], vectors[len(queries) + j])),
                num_cached_tokens=outs[i].num_cached_tokens
                + outs[len(queries) + j].num_cached_tokens,
            )
            for i, j in pairs
        ]

    def _pair_ids(self, query: str, document: str) -> list[int]:
        """A cross-encoder's input for one pair (``ClassifierConfig.pair_separator``)."""
        tokenizer = self.get_tokenizer()
        classifier = self.engine.config.model_config.classifier
        assert classifier is not None, "only a cross-encoder reads pairs"
        if not classifier.pair_separator:
            return tokenizer.encode(query + document)
        first, second = tokenizer.encode(query, False), tokenizer.encode(document, False)
        return tokenizer.join_pair(first, second)

    def _classifier(self, what: str) -> None:
        if self.engine.config.model_config.classifier is None:
            raise RequestError(
                f"{what} needs a sequence classifier (*ForSequenceClassification); this model"
                f" is {self.engine.config.model_config.architecture}",
                param="model",
            )

    def _pool(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        """Runs every prompt as a pooled request; their finished outputs, in order."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            pooling_list = list(pooling_params)
            if len(pooling_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(pooling_list)} pooling params for {len(prompt_list)} prompts"
                )
        params_list = self._with_lora([SamplingParams()] * len(prompt_list), lora_request)
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, params, pooling in zip(prompt_list, params_list, pooling_list, strict=True):
            _, ids = self._encode(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, ids, params, pooling=pooling)
            order.append(request_id)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                results[out.request_id] = out
            self.engine.flush_cache_events()
        return [results[request_id] for request_id in order]

    def _with_lora(
        self,
        params_list: list[SamplingParams],
        lora_request: LoRARequest | Seq[LoRARequest | None] | None,
    ) -> list[SamplingParams]:
        """The params with each prompt's adapter named (and loaded, on first use)."""
        if lora_request is None:
            return params_list
        loras = [lora_request] * len(params_list) if isinstance(lora_request, LoRARequest) else (
            list(lora_request)
        )  # fmt: skip
        if len(loras) != len(params_list):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(params_list)} prompts")
        out = []
        for params, lora in zip(params_list, loras):
            if lora is not None:
                self.engine.add_lora(lora.lora_name, lora.lora_path)
                params = replace(params, lora_name=lora.lora_name)
            out.append(params)
        return out

    def chat(
        self,
        messages: Seq[Message] | Seq[Seq[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[GenerateOutput]:
        """Applies the chat template to one conversation or a list of them, then generates
        (``lora_request`` as for ``generate``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        requests: list[tuple[str | None, list[int]]] = []
        for conv in conversations:
            text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
            requests.append((text, tok.encode(text, add_special_tokens=False)))
        params_list = _as_params_list(sampling_params, len(requests))
        return self._run(requests, self._with_lora(params_list, lora_request))

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._encode(str(prompt["prompt"]))
        return None, list(prompt)

    def _run(
        self, requests: list[tuple[str | None, list[int]]], params_list: list[SamplingParams]
    ) -> list[GenerateOutput]:
        results: list[GenerateOutput] = []
        owners: dict[str, tuple[GenerateOutput, int]] = {}
        for (text, ids), params in zip(requests, params_list):
            out = GenerateOutput(str(next(self._ids)), text, ids)
            results.append(out)
            for i in range(params.n):
                sub_params = params
                if params.n > 1:
                    seed = None if params.seed is None else params.seed + i
                    sub_params = replace(params, n=1, seed=seed)
                sub_id = f"{out.request_id}-{i}"
                self.engine.add_request(sub_id, ids, sub_params)
                owners[sub_id] = (out, i)
                out.outputs.append(CompletionOutput(i, "", [], None))
        while self.engine.has_unfinished_requests():
            step_outputs = self.engine.step()
            self.engine.flush_cache_events()
            for step_out in step_outputs:
                if step_out.finished:
                    owner, index = owners[step_out.request_id]
                    owner.outputs[index] = _completion(index, step_out, params_list)
                    if step_out.prompt_logprobs is not None:
                        owner.prompt_logprobs = list(step_out.prompt_logprobs)
                    owner.num_cached_tokens = max(
                        owner.num_cached_tokens, step_out.num_cached_tokens
                    )
        return results


def _completion(index: int, out: RequestOutput, _params: list[SamplingParams]) -> CompletionOutput:
    logprobs = out.logprobs if any(lp is not None for lp in out.logprobs) else None
    cumulative = sum(lp.logprob for lp in logprobs if lp is not None) if logprobs else None
    return CompletionOutput(
        index,
        out.text,
        list(out.token_ids),
        out.finish_reason,
        out.stop_reason,
        logprobs,
        cumulative,
    )


def _as_prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Seq[SamplingParams] | None, num: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num
    if isinstance(params, SamplingParams):
        return [params] * num
    if len(params) != num:
        raise ValueError(f"got {len(params)} sampling params for {num} prompts")
    return list(params)


def _vector(out: RequestOutput) -> torch.Tensor:
    assert out.embedding is not None, "a pooled request's output holds its vector"
    return out.embedding
