"""The iteration-level engine both worker roles run: scheduler + runner + detokenizer.

``step()`` is the whole loop: schedule, run, update, then turn new tokens into text and
apply stop strings. Requests are added and aborted between steps by the same thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvrelay.cachetier.manager import TieredCache
from kvrelay.engine.block_manager import BlockManager, CacheEvents
from kvrelay.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvrelay.engine.identity import model_identity
from kvrelay.engine.loader import TORCH_DTYPES, check_model_dir, load_weights
from kvrelay.engine.lora import LoRAAdapter, LoRAError, load_adapter
from kvrelay.engine.models.llama import LlamaModel
from kvrelay.engine.offload import TierConnector
from kvrelay.engine.pooling import PoolState
from kvrelay.engine.runner import ModelRunner, kv_cache_shape
from kvrelay.engine.sampling import Sampler
from kvrelay.engine.scheduler import Scheduler, StepPlan
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.engine.structured import GrammarCache, GrammarError
from kvrelay.kernels.gemv import MAX_ROWS as _GEMV_ROWS
from kvrelay.protocol.pooling import PoolerConfig, PoolingConfigError, PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams, TokenLogprobs
from kvrelay.protocol.speculative import SpeculativeConfig
from kvrelay.text.stop import StopChecker
from kvrelay.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


KvAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""Makes the KV pool tensor (zeroed) of a shape and dtype on a device; workers share it
(a shared-memory segment on CPU, a CUDA IPC handle on a GPU)."""


def _allocate_local(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16): torch's bfloat16
    matmuls run on a slow conversion path without either."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # cannot tell (not Linux): say nothing
    flags = set(next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def note_cpu_dtype(device: torch.device, dtype: str) -> None:
    """Logs how bfloat16 runs on a CPU without native BF16, where torch's bfloat16 GEMMs take a
    conversion path 8-190x slower than float32's (an AVX2 CPU; BENCHMARKS.md): steps of many
    rows multiply float32 copies of the weights there (``gemv.widens_bfloat16``)."""
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_has_native_bf16():
        logger.info(
            "bfloat16 on a CPU without AVX512-BF16 or AMX: prompts and large batches multiply "
            "float32 copies of the weights (twice their bytes) and round to bfloat16; lone "
            "decode steps read the bfloat16 weights in kvrelay's native kernel"
        )


def resolve_device(name: str) -> torch.device:
    """The torch device for ``EngineConfig.device``; ConfigError when it cannot run here."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA device here")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s)"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # kernels, streams and IPC handles of this process use it
    return device


class RequestError(ValueError):
    """A request the engine cannot run (too long, bad parameters); nothing was queued.

    ``param`` names the request field at fault when the client sent something invalid (a
    schema that does not compile); None for limits of this engine.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step; ``new_*`` hold only this step's part."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # params.prompt_logprobs set: one per prompt token (None for the first), from the
    # process that computed the prompt (a decode worker's import has none)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # an embedding request (``add_request(pooling=...)``), once finished: float32 ``[dims]``
    embedding: torch.Tensor | None = None


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
        kv_cache = (kv_allocator or _allocate_local)(kv_shape, kv_dtype, device)
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
            self._check_pooling(pooling)
        elif not self.config.model_config.generates:
            mc = self.config.model_config
            serves = (
                "classifies and scores only (/classify, /score, /rerank, LLM.classify)"
                if mc.classifier is not None
                else "computes embeddings only (/v1/embeddings, LLM.embed)"
            )
            raise RequestError(
                f"this model ({mc.architecture}) has no LM head: it {serves}", param="model"
            )
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
        self._validate(prompt_token_ids, outputs, pooled)
        self._validate_params(params)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (engine started without one)")
        prompt = list(prompt_token_ids)
        seq = Sequence(request_id, prompt, params, time.monotonic(), token_ids=prompt + outputs)
        if params.lora_name is not None:
            seq.lora = self.loras[params.lora_name]  # _validate_params: it is loaded
        if params.structured_outputs is not None:
            # a re-run or a hand-off replays the tokens already sent: matcher state never travels
            try:
                seq.matcher = self.grammars.create_matcher(params.structured_outputs, outputs)
            except GrammarError as exc:
                raise RequestError(str(exc), param=exc.param) from exc
        return seq

    def _check_pooling(self, pooling: PoolingParams) -> None:
        hidden = self.config.model_config.hidden_size
        if pooling.dimensions is not None and self.config.model_config.classifier is not None:
            raise RequestError(
                "'dimensions' applies to embeddings; this model classifies (one score per label)",
                param="dimensions",
            )
        if pooling.dimensions is not None and pooling.dimensions > hidden:
            raise RequestError(
                f"'dimensions' is {pooling.dimensions}; this model's embeddings have {hidden}",
                param="dimensions",
            )

    def _validate(
        self, prompt_token_ids: list[int], output_token_ids: list[int], pooled: bool = False
    ) -> None:
        max_len = self.config.scheduler.max_model_len
        vocab = self.config.model_config.vocab_size
        if not prompt_token_ids:
            raise RequestError("prompt is empty")
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if pooled and num_tokens > max_len:
            raise RequestError(
                f"input has {num_tokens} tokens; this model's context window is {max_len}"
            )
        if not pooled and num_tokens >= max_len:
            raise RequestError(
                f"prompt has {num_tokens} tokens; this model's context window is "
                f"{max_len} tokens and at least one must be left for output"
            )
        tokens = (*prompt_token_ids, *output_token_ids)
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of range [0, {vocab})")

    def _validate_params(self, params: SamplingParams) -> None:
        """The params' token ids against this model's vocabulary and eos."""
        error = params.vocab_error(self.config.model_config.vocab_size)
        if error is not None:
            raise RequestError(error[1], param=error[0])
        if params.lora_name is not None and params.lora_name not in self.loras:
            loaded = ", ".join(sorted(self.loras)) or "none"
            raise RequestError(
                f"LoRA adapter {params.lora_name!r} is not loaded here (loaded: {loaded})",
                param="model",
            )
        if params.priority and self.config.scheduler.scheduling_policy != "priority":
            raise RequestError(
                f"'priority' is {params.priority}, but this engine schedules first come, first"
                " served (start it with --scheduling-policy priority)",
                param="priority",
            )
        allowed = params.allowed_token_ids
        if allowed is not None and params.min_tokens:
            ends = {*self.eos_token_ids, *params.stop_token_ids}
            if ends.issuperset(allowed):
                raise RequestError(
                    "'allowed_token_ids' holds only end-of-sequence and stop ids, which "
                    "'min_tokens' masks: nothing could be sampled",
                    param="allowed_token_ids",
                )

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

    def warm_up(self, prompt_len: int = 128, batch: int = _GEMV_ROWS + 2) -> float:
        """Runs throwaway requests through every kind of step before the engine serves, and
        returns the seconds it took.

        The first steps of a fresh process pay one-time costs: Triton compiles its kernels,
        cuBLAS and torch's allocator set up, MKL / oneDNN build kernels for each new shape.
        On a GPU it then compiles every variant of the Triton kernels an eager step may
        launch (``ModelRunner.compile_kernels``) and captures the CUDA graph of every decode
        batch size (``DecodeGraphs.capture_all``) and the graph of every padded token count
        of the other steps (``StepGraphs.capture_all``; ``LayerGraphs`` with SDPA's
        prefill). Serving workers run it on GPUs only: on CPUs, with packed weights and the
        native kernels, a fresh 1P+1D ``kvrelay up`` served its first requests as fast
        without it and was ready 1.1 s sooner (it once made a fresh kvrelay's first
        benchmark run 3x faster: TTFT p50 446 ms against 130 ms). One prompt of
        ``prompt_len`` tokens (capped by the context and the step budget) and ``batch - 1``
        short ones, a few greedy tokens each: a long prefill, a batched prefill, batched
        decode steps and then, the long one alone, lone decode steps. Nothing remains: the
        blocks are freed and dropped from the prefix cache (call it before serving: the
        whole cache is emptied) before any cache event leaves, the cache tiers are not
        consulted, and the prefix-cache counters are restored.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up needs an idle engine")
        started = time.perf_counter()
        bm, scheduler = self.block_manager, self.scheduler
        counters = (bm.num_query_tokens, bm.num_hit_tokens, scheduler.num_preemptions)
        loader, scheduler.prefix_loader = scheduler.prefix_loader, None
        vocab, max_len = self.config.model_config.vocab_size, self.max_model_len
        budget = self.config.scheduler.max_num_batched_tokens
        lengths = [max(1, min(prompt_len, max_len - 4, budget))]
        lengths += [max(1, min(16, max_len - 4))] * (min(batch, scheduler.config.max_num_seqs) - 1)
        ids = [f"warm-up-{n}" for n in range(len(lengths))]
        try:
            for n, (request_id, length) in enumerate(zip(ids, lengths, strict=True)):
                tokens = [(n * 131 + t * 7919) % vocab for t in range(length)]
                # the long one outlives the others: its last steps are a lone decode
                params = SamplingParams(
                    temperature=0.0, max_tokens=6 if n == 0 else 3, ignore_eos=True
                )
                # an embedding checkpoint pools instead (it has no head to sample with)
                pooling = None if self.config.model_config.generates else PoolingParams()
                self.add_request(request_id, tokens, params, pooling=pooling)
            while self.has_unfinished_requests():
                self.step()
        finally:
            for request_id in ids:
                self.abort_request(request_id)
            scheduler.prefix_loader = loader
            bm.reset_prefix_cache()
            bm.pop_events()  # the stores and the evictions the reset made: never sent
            bm.num_query_tokens, bm.num_hit_tokens, scheduler.num_preemptions = counters
        self.runner.compile_kernels()  # GPU: the eager steps' kernel variants
        if self.runner.graphs is not None:  # every decode batch size, before anything is served
            self.runner.graphs.capture_all()
        if self.runner.step_graphs is not None:  # and every token count of the other steps
            self.runner.step_graphs.capture_all()
        if self.runner.layer_graphs is not None:
            self.runner.layer_graphs.capture_all()
        return time.perf_counter() - started

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
                outputs.append(_pooled_output(item.seq))
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


def _pooled_output(seq: Sequence) -> RequestOutput:
    """The one output of an embedding request: finished, its vector, no tokens."""
    return RequestOutput(
        request_id=seq.seq_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=[],
        new_token_ids=[],
        text="",
        new_text="",
        finished=True,
        finish_reason=seq.finish_reason,
        num_cached_tokens=seq.num_cached_tokens,
        cached_tokens_by_tier=seq.cached_tokens_by_tier,
        embedding=seq.pool.embedding,
    )
