"""The iteration-level engine both worker roles run: scheduler + runner + detokenizer.

``step()`` is the whole loop: schedule, run, update, then turn new tokens into text and
apply stop strings. Requests are added and aborted between steps by the same thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvrelay.cachetier.manager import TieredCache
from kvrelay.engine.admission import (
    RequestError,
    check_generates,
    check_params,
    check_pooling,
    check_tokens,
)
from kvrelay.engine.block_manager import BlockManager, CacheEvents
from kvrelay.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvrelay.engine.device import (
    KvAllocator,
    allocate_local,
    keep_step_memory,
    note_cpu_dtype,
    resolve_device,
)
from kvrelay.engine.identity import model_identity
from kvrelay.engine.loader import TORCH_DTYPES, check_model_dir, load_weights
from kvrelay.engine.lora import LoRAAdapter, LoRAError, load_adapter
from kvrelay.engine.models.llama import LlamaModel
from kvrelay.engine.offload import TierConnector
from kvrelay.engine.outputs import RequestOutput, pooled_output
from kvrelay.engine.pooling import PoolState
from kvrelay.engine.runner import ModelRunner, kv_cache_shape
from kvrelay.engine.sampling import Sampler
from kvrelay.engine.scheduler import Scheduler, StepPlan
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.engine.structured import GrammarCache, GrammarError
from kvrelay.engine.warm_up import run_warm_up
from kvrelay.protocol.pooling import PoolerConfig, PoolingConfigError, PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams
from kvrelay.protocol.speculative import SpeculativeConfig
from kvrelay.text.stop import StopChecker
from kvrelay.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def build_engine_config(model: str, dtype: str = "float32", **kwargs: Any) -> EngineConfig:
    """Splits flat vLLM-style keyword arguments into the frozen per-part configs."""
    cache_keys = set(CacheConfig.__dataclass_fields__)
    sched_keys = set(SchedulerConfig.__dataclass_fields__)
    engine_keys = {
        "seed", "num_threads", "device", "lora_modules", "speculative_config", "pooler_config"
    }  # fmt: skip
    unknown = set(kwargs) - cache_keys - sched_keys - engine_keys
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    model_config = ModelConfig.from_dir(check_model_dir(model))
    max_len = kwargs.get("max_model_len") or model_config.max_position_embeddings
    sched = {k: v for k, v in kwargs.items() if k in sched_keys}
    sched["max_model_len"] = max_len
    configs: dict[str, Any] = {
        "speculative_config": SpeculativeConfig, "pooler_config": PoolerConfig
    }  # fmt: skip
    for key, config_type in configs.items():
        value = kwargs.get(key)
        if isinstance(value, Mapping):  # vLLM's dict
            try:
                kwargs[key] = config_type.from_dict(value)
            except ValueError as e:  # the config's own error, naming the key
                raise ConfigError(str(e)) from None
    return EngineConfig(
        model=str(model),
        dtype=dtype,  # type: ignore[arg-type]
        model_config=model_config,
        cache=CacheConfig(**{k: v for k, v in kwargs.items() if k in cache_keys}),
        scheduler=SchedulerConfig(**sched),
        **{k: v for k, v in kwargs.items() if k in engine_keys},
    )


def step_kind(plan: StepPlan) -> str:
    """``decode`` when every scheduled item is one decode token, ``prefill`` when none is (prompt
    chunks, or the recomputed outputs of a resumed request), else ``mixed``."""
    decode = sum(
        item.num_new_tokens - len(item.draft) == 1
        and item.start == item.seq.num_tokens - 1
        and item.start >= len(item.seq.prompt_token_ids)
        for item in plan.scheduled
    )
    return "decode" if decode == len(plan.scheduled) else "prefill" if not decode else "mixed"


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        kv_allocator: KvAllocator | None = None,
        tiers: TieredCache | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Builds the engine.

        Args:
            config: validated engine settings.
            tokenizer: for text and stop strings; None for token-id-only workers.
            kv_allocator: makes the KV pool (workers put it in shared memory).
            tiers: cache tiers below the device pool (host pool, Redis), or None.
            weights: runtime weights already prepared (``loader.prepare_weights`` names),
                e.g. zero-copy views of a parameter pool; None loads the checkpoint.
        """
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = config.model_config
        self.device = device = resolve_device(config.device)
        note_cpu_dtype(device, config.dtype)
        if device.type == "cpu":
            keep_step_memory()
        self.tokenizer = tokenizer
        self.fingerprint = model_identity(config.model, config.dtype)
        if weights is None:
            weights = load_weights(config.model, mc, config.dtype)
        # on CPU ``.to`` returns the same tensors: a parameter pool's views stay zero-copy
        weights = {name: w.to(device) for name, w in weights.items()}
        num_blocks = config.cache.num_blocks or self._blocks_for_memory(config)
        max_len = min(config.scheduler.max_model_len, num_blocks * config.cache.block_size)
        self.config = config = replace(
            config, scheduler=replace(config.scheduler, max_model_len=max_len)
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self.fingerprint,
        )
        eos = set(mc.eos_token_ids) | (set(tokenizer.eos_token_ids) if tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        kv_shape = kv_cache_shape(mc, num_blocks, config.cache.block_size)
        kv_dtype = TORCH_DTYPES[config.dtype]
        kv_cache = (kv_allocator or allocate_local)(kv_shape, kv_dtype, device)
        if kv_cache.device != device:
            raise ValueError(f"the KV allocator returned a pool on {kv_cache.device}, not {device}")
        self.connector = TierConnector(tiers, kv_cache, config.dtype) if tiers else None
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            self.eos_token_ids,
            self.connector,
            config.speculative_config,
        )
        sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.runner = ModelRunner(
            LlamaModel(mc, weights),
            kv_cache,
            config.cache.block_size,
            sampler,
            config.scheduler.max_num_seqs,
            max_len,
            config.scheduler.max_num_batched_tokens,
        )
        self._stops: dict[str, StopChecker] = {}
        try:  # how embedding requests pool: the setting, the checkpoint's, else the last token
            pooler = config.pooler_config or PoolerConfig.from_model_dir(config.model)
        except PoolingConfigError as e:
            raise ConfigError(str(e)) from None
        self.pooler = pooler or PoolerConfig()
        self.last_step_kind = "decode"  # of the last step that ran (step_kind)
        self.grammars = GrammarCache(config.model, mc.vocab_size, self.eos_token_ids)
        self.loras: dict[str, LoRAAdapter] = {}  # by name (SamplingParams.lora_name)
        for name, path in config.lora_modules:
            self.add_lora(name, path)

    def add_lora(self, name: str, path: str) -> LoRAAdapter:
        """Loads the PEFT adapter in ``path`` as ``name`` (``engine.lora``); the adapter
        already loaded under that name when it comes from the same directory (or ``path`` is
        empty). Raises ``LoRAError`` for an adapter this model cannot serve, or a name taken
        by another."""
        known = self.loras.get(name)
        if known is not None:
            if path and Path(known.path).resolve() != Path(path).resolve():
                raise LoRAError(f"LoRA adapter {name!r} is already loaded from {known.path}")
            return known
        if not path:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded, and no path was given")
        cfg = self.config
        dtype = TORCH_DTYPES[cfg.dtype]
        adapter = load_adapter(name, path, cfg.model_config, dtype, self.device)
        self.loras[name] = adapter
        logger.info("LoRA adapter %s: %d modules, rank %d, from %s",
                    name, adapter.num_modules, adapter.rank, path)  # fmt: skip
        return adapter

    @classmethod
    def from_args(
        cls,
        model: str | Path,
        dtype: str = "float32",
        skip_tokenizer_init: bool = False,
        **kwargs: Any,
    ) -> LLMEngine:
        config = build_engine_config(str(model), dtype, **kwargs)
        tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(model)
        return cls(config, tokenizer)

    @staticmethod
    def _blocks_for_memory(config: EngineConfig) -> int:
        elem = torch.empty((), dtype=TORCH_DTYPES[config.dtype]).element_size()
        per_block = config.model_config.kv_bytes_per_token * elem * config.cache.block_size
        return max(1, config.cache.kv_cache_memory_bytes // per_block)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_token_ids: list[int] | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queues a request; raises RequestError (queuing nothing) when it cannot run.

        ``output_token_ids`` are tokens already generated (and streamed) elsewhere: the
        request resumes after them, recomputing their KV with the prompt. ``pooling``: an
        embedding request (``engine.pooling``): the prompt is computed and pooled, its one
        output is finished and holds ``embedding``; ``params`` only name a LoRA adapter.
        """
        if pooling is not None:
            check_pooling(self.config.model_config, pooling)
        else:
            check_generates(self.config.model_config)
        seq = self._new_sequence(
            request_id, prompt_token_ids, params, output_token_ids, pooling is not None
        )
        if pooling is not None:
            seq.pool = PoolState.resolve(self.pooler, pooling, self.config.model_config.classifier)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.scheduler.add(seq)
        if pooling is not None:
            return
        self._stops[request_id] = StopChecker(
            self.tokenizer, seq.prompt_token_ids, params, seq.output_token_ids
        )

    def import_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        block_ids: list[int],
        num_cached_tokens: int = 0,
        cached_tokens_by_tier: dict[str, int] | None = None,
    ) -> None:
        """Adds a request whose KV another instance computed and that is now in ``block_ids``.

        The blocks hold the KV of every token but the newest output token; the request
        takes over their references (from ``block_manager.take_blocks``).
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, output_token_ids)
        expected = -(-(seq.num_tokens - 1) // self.block_manager.block_size)
        if not output_token_ids or len(block_ids) != expected:
            raise RequestError(
                f"import of {request_id!r}: {len(block_ids)} blocks for {seq.num_tokens - 1} "
                f"tokens of KV (expected {expected}) and {len(output_token_ids)} output tokens"
            )
        seq.block_ids = list(block_ids)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_cached_tokens = num_cached_tokens
        seq.cached_tokens_by_tier = dict(cached_tokens_by_tier or {})
        self.scheduler.add_running(seq)
        self._stops[request_id] = StopChecker(
            self.tokenizer, seq.prompt_token_ids, params, seq.output_token_ids
        )

    def detach_request(self, request_id: str) -> Sequence | None:
        """Takes a running request out of the engine, keeping its blocks (prefill hand-off).

        The caller owns one reference to each of the returned sequence's ``block_ids``.
        """
        self._stops.pop(request_id, None)
        return self.scheduler.detach(request_id)

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None,
        pooled: bool = False,
    ) -> Sequence:
        outputs = list(output_token_ids or [])
        check_tokens(self.config, prompt_token_ids, outputs, pooled)
        check_params(self.config, params, self.loras, self.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (engine started without one)")
        prompt = list(prompt_token_ids)
        seq = Sequence(request_id, prompt, params, time.monotonic(), token_ids=prompt + outputs)
        if params.lora_name is not None:
            seq.lora = self.loras[params.lora_name]  # check_params: it is loaded
        if params.structured_outputs is not None:
            # a re-run or a hand-off replays the tokens already sent: matcher state never travels
            try:
                seq.matcher = self.grammars.create_matcher(params.structured_outputs, outputs)
            except GrammarError as exc:
                raise RequestError(str(exc), param=exc.param) from exc
        return seq

    def flush_cache_events(self) -> CacheEvents:
        """Offers newly cached blocks to the tiers; returns the device cache's events.

        Call after a step's tokens were sent (it copies blocks out: not on the TTFT path).
        """
        events = self.block_manager.pop_events()
        if self.connector is not None and events.stored:
            self.connector.offload(events.stored)
        return events

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def abort_request(self, request_id: str) -> bool:
        """Ends a request now and frees its blocks; False if it is unknown or finished."""
        self._stops.pop(request_id, None)
        return self.scheduler.finish(request_id, SequenceStatus.FINISHED_ABORTED) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # throwaway requests through every kind of step before serving (``engine.warm_up``)
    warm_up = run_warm_up

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns an output for every request that made progress."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        self.last_step_kind = step_kind(plan)
        result = self.runner.run(plan)
        self.scheduler.update(plan, result)
        outputs = []
        for item, token_ids in zip(plan.scheduled, result.token_ids):
            if token_ids:
                outputs.append(self._make_output(item.seq, token_ids))
            elif item.seq.pool is not None and item.seq.status is SequenceStatus.FINISHED_STOPPED:
                outputs.append(pooled_output(item.seq))
        return outputs

    def remove_lora(self, name: str) -> None:
        """Drops the LoRA adapter ``name``: new requests for it are refused, running ones
        finish on it. Raises ``LoRAError`` when none is loaded under that name."""
        if self.loras.pop(name, None) is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        logger.info("LoRA adapter %s unloaded", name)

    def _make_output(self, seq: Sequence, token_ids: list[int]) -> RequestOutput:
        """The output of a step's tokens for ``seq`` (more than one after a draft); a stop
        string in one of them ends the sequence there and drops the tokens after it."""
        stop = self._stops[seq.seq_id]
        new_text = ""
        for j, token_id in enumerate(token_ids):
            last = j == len(token_ids) - 1
            text, stop_str = stop.append(token_id, finished=seq.is_finished and last)
            new_text += text
            if stop_str is not None and not (seq.is_finished and last):
                dropped = len(token_ids) - 1 - j
                if dropped:  # the tokens after it (a draft's)
                    del seq.token_ids[-dropped:], seq.output_logprobs[-dropped:]
                    del token_ids[j + 1 :]
                if seq.is_finished:  # by a later token of the same step
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                seq.stop_reason = stop_str
                new_text += stop.flush()
                break
        if seq.is_finished:
            del self._stops[seq.seq_id]
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            new_token_ids=token_ids,
            text=stop.text,
            new_text=new_text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.output_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            cached_tokens_by_tier=seq.cached_tokens_by_tier,
            prompt_logprobs=seq.prompt_logprobs,
        )
