"""Grammar-constrained decoding with xgrammar: compiled grammars and per-sequence matchers.

``GrammarCache`` compiles a ``StructuredOutput`` once per tokenizer (an LRU of compiled
grammars) and makes a fresh ``GrammarMatcher`` per sequence. A sequence's matcher has accepted
exactly its output tokens, in order::

    output:  [ o0 o1 ... o(k-1) ]      matcher state == after accept(o0) ... accept(o(k-1))
    next:    mask = matcher.fill_next_token_bitmask   (sampler)  ->  token t
             matcher.accept_token(t)                             (runner, after the step)

A sequence that arrives with output tokens (a decode worker taking over after prefill, a
re-run after a worker died) gets a new matcher that replays them (``create_matcher``): matcher
state never travels. Eos (and the grammar's other stop tokens) is allowed only where the
grammar may end.

xgrammar imports torch and transformers, so only the engine imports this module, and lazily.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvrelay.protocol.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

DEFAULT_GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per engine


class GrammarError(ValueError):
    """A structured-output spec that does not compile (bad schema, regex or grammar)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _param_of(kind: str) -> str:
    """The request field a spec of ``kind`` came from (the router's convention)."""
    return {"json": "response_format", "json_object": "response_format"}.get(
        kind, f"structured_outputs.{kind}"
    )


class GrammarCache:
    """Compiled grammars of one tokenizer, least recently used dropped first.

    Args:
        model_dir: the checkpoint whose tokenizer the masks are over.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: the engine's eos ids: the only tokens that may end a grammar.
        capacity: compiled grammars kept.
    """

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        capacity: int = DEFAULT_GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._capacity = capacity
        self._compiler: Any = None
        self._json_bits: torch.Tensor | None = None  # int32 words: tokens valid JSON may hold
        self._grammars: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations (cache misses), for tests and metrics

    def warm_up(self) -> None:
        """Imports xgrammar and builds the tokenizer's tables now (about 1 s), so the first
        structured request does not stall the caller's loop for that."""
        with self._lock:
            self._get_compiler()

    def warm_up_in_background(self) -> threading.Thread:
        """``warm_up`` on a daemon thread: a worker serves meanwhile, and a structured
        request that comes before it is done waits for it (the lock) instead of building the
        tables a second time. A failure is logged; the first structured request then raises
        it as its own error.

        The thread keeps the caller's priority: the build holds the GIL for up to ~0.2 s at a
        time (the tokenizer's JSON, xgrammar's tables), and at a lower priority on busy cores
        those stretches grew to 1.7-1.8 s of wall time, in which no other thread of the
        process ran, the heartbeat's included (``background``'s docstring)."""

        def build() -> None:
            try:
                self.warm_up()
            except Exception:  # the request that needs the tables reports it again
                logger.exception("building the grammar compiler's tokenizer tables failed")

        thread = threading.Thread(target=build, name="grammar-warm-up", daemon=True)
        thread.start()
        return thread

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``; raises GrammarError naming the request field."""
        with self._lock:
            grammar = self._grammars.get(spec)
            if grammar is not None:
                self._grammars.move_to_end(spec)
                return grammar
            grammar = self._compile(spec)
            self.num_compiled += 1
            self._grammars[spec] = grammar
            if len(self._grammars) > self._capacity:
                self._grammars.popitem(last=False)
            return grammar

    def create_matcher(self, spec: StructuredOutput, accepted: Sequence[int] = ()) -> Any:
        """A matcher at the start of ``spec``'s grammar that has then accepted ``accepted``.

        Raises:
            GrammarError: the spec does not compile, or ``accepted`` breaks the grammar.
        """
        import xgrammar as xgr

        grammar = self.compile(spec)
        is_json = spec.kind in ("json", "json_object")
        matcher = SequenceGrammar(xgr.GrammarMatcher(grammar), self._json_bits if is_json else None)
        for token_id in accepted:
            if not matcher.accept_token(token_id):
                raise GrammarError(f"output token {token_id} does not match the grammar")
        return matcher

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":  # an object (xgrammar's builtin is any JSON value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_regex("|".join(_regex_literal(c) for c in spec.choices))
            return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            param = _param_of(spec.kind)
            raise GrammarError(f"invalid '{param}': {exc}", param) from exc

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            start = time.monotonic()
            import xgrammar as xgr

            tokenizer = _hf_tokenizer(self._model_dir)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._json_bits = _without_control_chars(info.decoded_vocab, self.vocab_size)
            logger.info(
                "built the grammar compiler's tokenizer tables in %.2f s (%s thread)",
                time.monotonic() - start, threading.current_thread().name,
            )  # fmt: skip
        return self._compiler


def _hf_tokenizer(model_dir: str) -> Any:
    """The checkpoint's tokenizer as transformers holds it, for xgrammar's tables.

    From ``tokenizer.json`` directly (``PreTrainedTokenizerFast``, 0.1 s) where there is one:
    xgrammar reads only the vocabulary and the backend's JSON, which are the same as through
    ``AutoTokenizer``, whose config lookups and lazy model-class imports took 1.5 s of a
    worker's start (SmolLM2: identical tables, tests/test_structured_engine.py). Else
    ``AutoTokenizer`` (a SentencePiece-only checkpoint, converted by transformers)."""
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if tokenizer_json.is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _without_control_chars(decoded_vocab: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token except those holding a control character (U+0000 to
    U+001F). xgrammar's JSON strings admit raw control characters, which JSON forbids (and
    ``json.loads`` refuses); compact JSON (no newlines, ``any_whitespace=False``) never holds
    one, so a JSON grammar's mask is ANDed with this row."""
    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    for token_id, text in enumerate(decoded_vocab[:vocab_size]):
        if any(byte < 0x20 for byte in text):
            allowed[token_id] = False
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class SequenceGrammar:
    """One sequence's matcher, plus the tokens its kind of grammar never allows."""

    __slots__ = ("_allowed", "_matcher")

    def __init__(self, matcher: Any, allowed: torch.Tensor | None) -> None:
        self._matcher = matcher
        self._allowed = allowed

    @property
    def matcher(self) -> Any:
        """The xgrammar matcher (``GrammarMasker`` fills many at once)."""
        return self._matcher

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)
        self.restrict(bitmask, index)

    def restrict(self, bitmask: torch.Tensor, index: int) -> None:
        """Clears the tokens this kind of grammar never allows from row ``index``."""
        if self._allowed is not None:
            bitmask[index].bitwise_and_(self._allowed)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` accepted tokens (a speculative draft's)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)


class FixedMask:
    """A next-token mask filled earlier, standing in for a matcher in ``GrammarMasker``: a
    speculative draft's row j is masked by its matcher's state after the draft's first j
    tokens, which no longer exists when the step's masks are filled (``draft_masks``)."""

    __slots__ = ("_row",)

    def __init__(self, row: torch.Tensor) -> None:
        self._row = row

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].copy_(self._row)


def draft_masks(grammar: SequenceGrammar, draft: Sequence[int], vocab_size: int) -> list[FixedMask]:
    """The masks of a draft's ``len(draft) + 1`` rows: row j's is the grammar's state after
    ``draft[:j]``. Where the grammar refuses a draft token (or has ended), the rows after it
    repeat the last mask: row j's own mask already refuses that token, so the sampler never
    keeps it, and the rows after are dropped. The matcher is left as it was."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(draft) + 1, vocab_size)
    accepted = 0
    for j in range(len(draft) + 1):
        if j and (accepted < j - 1 or not grammar.accept_token(draft[j - 1])):
            bitmask[j].copy_(bitmask[j - 1])
            continue
        accepted = j
        if j and grammar.is_terminated():
            bitmask[j].copy_(bitmask[j - 1])  # after the draft's eos: the row is dropped
            continue
        grammar.fill_next_token_bitmask(bitmask, j)
    grammar.rollback(accepted)
    return [FixedMask(bitmask[j]) for j in range(len(draft) + 1)]


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching only itself (xgrammar's regex dialect: ECMAScript)."""
    special = set("\\^$.|?*+()[]{}/")
    return "".join(f"\\{c}" if c in special else c for c in text)


class GrammarMasker:
    """Applies the matchers' next-token masks to a batch of logits, in place, batched.

    Keeps one bitmask buffer (int32, ``[rows, ceil(vocab / 32)]``) and grows it as needed.
    The rows' masks are filled by one ``BatchGrammarMatcher`` call on ``torch``'s thread
    count (xgrammar's C++ threads, the GIL released): filling is most of a grammar's cost
    per step, and the model's threads are idle meanwhile.
    """

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use

    def apply(self, scores: torch.Tensor, matchers: Sequence[Any]) -> None:
        """Sets to -inf every token a row's matcher refuses; rows whose matcher is None keep
        all tokens. ``scores`` is float32 ``[len(matchers), vocab]`` and is changed in place."""
        import xgrammar as xgr

        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        vocab_size = scores.shape[1]
        bitmask = self._buffer(len(rows), vocab_size)
        self._fill(bitmask, [matchers[row] for row in rows])
        bitmask = bitmask[: len(rows)]
        if len(rows) == scores.shape[0]:
            xgr.apply_token_bitmask_inplace(scores, bitmask.to(scores.device, non_blocking=True))
            return
        index = torch.tensor(rows, dtype=torch.long, device=scores.device)
        sub = scores[index]
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(scores.device, non_blocking=True))
        scores[index] = sub

    def _fill(self, bitmask: torch.Tensor, matchers: list[Any]) -> None:
        """Row ``j`` of ``bitmask`` := the mask of ``matchers[j]``; xgrammar's in one call."""
        import xgrammar as xgr

        grammars = [(j, m) for j, m in enumerate(matchers) if isinstance(m, SequenceGrammar)]
        if len(grammars) < 2:
            grammars = []  # one row fills itself below
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=torch.get_num_threads())
            rows = [j for j, _ in grammars]
            self._batch.batch_fill_next_token_bitmask(
                [g.matcher for _, g in grammars], bitmask, rows
            )
            for j, grammar in grammars:
                grammar.restrict(bitmask, j)
        batched = {j for j, _ in grammars}
        for j, matcher in enumerate(matchers):
            if j not in batched:  # one row, or a matcher of another kind (tests)
                matcher.fill_next_token_bitmask(bitmask, j)

    def _buffer(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        import xgrammar as xgr

        words = -(-vocab_size // 32)
        if (
            self._bitmask is None
            or self._bitmask.shape[0] < num_rows
            or (self._bitmask.shape[1] != words)
        ):
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), vocab_size)
        return self._bitmask
