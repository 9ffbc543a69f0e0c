"""Sampling parameters: the user-facing, torch-free half of sampling.

The router validates requests with these (it never imports torch); the engine's
``Sampler`` (``sampling.py``) applies them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import NamedTuple, NoReturn

MAX_N = 128  # completions per request
MAX_LOGPROBS = 20  # alternatives returned per token (OpenAI's limit)
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_TOKEN_IDS = 256  # stop token ids per request
MAX_CACHE_SALT_LEN = 256  # characters of cache_salt
MAX_LORA_NAME_LEN = 256  # characters of lora_name (lora_modules.MAX_NAME_LEN)
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency penalty, inclusive (OpenAI's range)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts, inclusive
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 1 << 20  # a schema / regex / grammar larger than this is refused
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # a token's logit_bias, inclusive (OpenAI's range)
MAX_TOKEN_LIST = 1 << 18  # entries of logit_bias / allowed_token_ids (the engine checks the vocab)


def _fail(name: str, value: object, rule: str) -> NoReturn:
    raise ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_pairs(value: object) -> tuple[object, ...]:
    """A logit_bias as sorted ``(token id, bias)`` pairs: from a mapping, or pairs (the wire
    sends them as lists); anything else is left for the check to name."""
    if isinstance(value, Mapping):
        items: Iterable[object] = value.items()
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = value
    else:
        return (value,)
    pairs = [tuple(p) if isinstance(p, (list, tuple)) else p for p in items]
    try:
        return tuple(sorted(pairs))  # type: ignore[type-var]
    except TypeError:  # mixed or odd keys: unsorted, the check names them
        return tuple(pairs)


def _as_tuple(value: object) -> tuple[object, ...]:
    """None -> (); a lone str or int -> (value,); any other iterable -> tuple(value)."""
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    if isinstance(value, Iterable):
        return tuple(value)
    return (value,)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must match (vLLM's ``structured_outputs``), as plain data.

    ``kind`` says how ``spec`` reads: ``json`` a JSON schema (serialised; key order kept: it
    is the order the grammar writes properties in), ``json_object`` any JSON object (``spec``
    empty), ``regex`` a regular expression, ``choice`` one of ``choices``, ``grammar`` an
    EBNF (GBNF) grammar.
    Hashable: it keys the engine's compiled-grammar cache.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", _as_tuple(self.choices))
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"StructuredOutput.kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(
                f"StructuredOutput.spec must be a string of at most {MAX_STRUCTURED_SPEC_CHARS}"
                " characters"
            )
        needs_spec = self.kind in ("json", "regex", "grammar")
        if needs_spec != bool(self.spec):
            raise ValueError(
                f"StructuredOutput.spec must be {'set' if needs_spec else 'empty'}"
                f" for kind {self.kind!r}"
            )
        if (self.kind == "choice") != bool(self.choices) or not all(
            isinstance(c, str) and c for c in self.choices
        ):
            raise ValueError(
                "StructuredOutput.choices must be non-empty strings for kind 'choice' only,"
                f" got {self.choices!r}"
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops; shaped like vLLM's.

    ``stop`` and ``stop_token_ids`` also accept a single value, a list or None and are
    normalised to tuples, so the object stays hashable.
    """

    n: int = 1  # completions to generate, in [1, MAX_N]
    temperature: float = 1.0  # >= 0; below GREEDY_TEMPERATURE decodes greedily
    top_p: float = 1.0  # in (0, 1]; nucleus mass kept
    top_k: int = 0  # 0 or -1 disables; else keep the k most likely tokens
    min_p: float = 0.0  # in [0, 1]; drop tokens below min_p * p(most likely)
    seed: int | None = None  # per-request generator seed; None shares the sampler's generator
    presence_penalty: float = 0.0  # in PENALTY_RANGE; subtracted once per seen output token
    frequency_penalty: float = 0.0  # in PENALTY_RANGE; subtracted per output occurrence
    repetition_penalty: float = 1.0  # > 0; HF-style, on prompt and output tokens
    max_tokens: int | None = 16  # >= 1; None runs up to the context window
    min_tokens: int = 0  # >= 0 and <= max_tokens; eos / stop ids masked until reached
    stop: tuple[str, ...] = ()  # non-empty strings, at most MAX_STOP_STRINGS
    stop_token_ids: tuple[int, ...] = ()  # ids >= 0, at most MAX_STOP_TOKEN_IDS
    ignore_eos: bool = False  # eos does not end generation (min_tokens masking still applies)
    logprobs: int | None = None  # None: none; 0: chosen token only; k: chosen + top-k
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    skip_special_tokens: bool = True  # drop special tokens when detokenising
    cache_salt: str | None = None  # prefix cache shared only with requests of the same salt
    structured_outputs: StructuredOutput | None = None  # a grammar the output must match
    # (token id, bias) pairs added to the logits before penalties and sampling; a mapping
    # {id: bias} is accepted and kept as sorted pairs; biases in LOGIT_BIAS_RANGE
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled; None: any
    # None: none; k: each prompt token's logprob (after the first) and the top k (0: none);
    # the prompt is computed whole, not taken from the prefix cache
    prompt_logprobs: int | None = None
    # token-id sequences that must not appear in the output: a sequence's last id is masked
    # while the output ends with the rest (vLLM's bad_words, tokenized by the router)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's request priority (lower runs first) under --scheduling-policy priority; 0
    # otherwise. A scheduling field, not a sampling one: carried here so that a worker that
    # cannot honour it never gets it (Register.sampling_fields)
    priority: int = 0
    # the LoRA adapter (as loaded by the worker, ``--lora-modules NAME=PATH``) the request
    # runs through; None: the base model. Clients name it as the request's ``model``
    lora_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(self.allowed_token_ids))
        words = _as_tuple(self.bad_words_token_ids)
        words = tuple(_as_tuple(w) if isinstance(w, (list, tuple)) else w for w in words)
        object.__setattr__(self, "bad_words_token_ids", words)
        self._check_sampling()
        self._check_penalties()
        self._check_lengths()
        self._check_stops()
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_LEN
        ):
            _fail(
                "cache_salt",
                self.cache_salt,
                f"None or a string of 1 to {MAX_CACHE_SALT_LEN} chars",
            )
        self._check_structured()
        self._check_token_lists()
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "a bool")

    def _check_sampling(self) -> None:
        if not (_is_int(self.n) and 1 <= self.n <= MAX_N):
            _fail("n", self.n, f"an integer in [1, {MAX_N}]")
        if not (_is_real(self.temperature) and self.temperature >= 0):
            _fail("temperature", self.temperature, "a finite number >= 0")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            _fail("top_p", self.top_p, "a number in (0, 1]")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            _fail("top_k", self.top_k, "an integer >= -1 (0 or -1 disables it)")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            _fail("min_p", self.min_p, "a number in [0, 1]")
        if not (_is_int(self.priority) and abs(self.priority) < 2**31):
            _fail("priority", self.priority, "an integer in (-2**31, 2**31)")
        if self.lora_name is not None and not (
            isinstance(self.lora_name, str) and 0 < len(self.lora_name) <= MAX_LORA_NAME_LEN
        ):
            _fail("lora_name", self.lora_name, f"None or 1-{MAX_LORA_NAME_LEN} characters")
        low, high = SEED_RANGE
        if self.seed is not None and not (_is_int(self.seed) and low <= self.seed <= high):
            _fail("seed", self.seed, f"None or an integer in [{low}, {high}]")

    def _check_penalties(self) -> None:
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and low <= value <= high):
                _fail(name, value, f"a number in [{low}, {high}]")
        if not (_is_real(self.repetition_penalty) and self.repetition_penalty > 0):
            _fail("repetition_penalty", self.repetition_penalty, "a finite number > 0")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            _fail("max_tokens", self.max_tokens, "None or an integer >= 1")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                _fail(name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", self.stop, f"at most {MAX_STOP_STRINGS} strings")
        for text in self.stop:
            if not (isinstance(text, str) and text):
                _fail("stop", text, "non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", self.stop_token_ids, f"at most {MAX_STOP_TOKEN_IDS} ids")
        for token_id in self.stop_token_ids:
            if not (_is_int(token_id) and token_id >= 0):
                _fail("stop_token_ids", token_id, "integers >= 0")

    def _check_structured(self) -> None:
        """A grammar decides when the output may end: eos must end it, and may come early."""
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutput):
            _fail("structured_outputs", self.structured_outputs, "None or a StructuredOutput")
        if self.ignore_eos:
            _fail("ignore_eos", self.ignore_eos, "false with structured outputs")
        if self.min_tokens:
            _fail("min_tokens", self.min_tokens, "0 with structured outputs")

    def _check_token_lists(self) -> None:
        low, high = LOGIT_BIAS_RANGE
        if len(self.logit_bias) > MAX_TOKEN_LIST:
            _fail("logit_bias", len(self.logit_bias), f"at most {MAX_TOKEN_LIST} entries")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                _fail("logit_bias", pair, "a mapping of token ids to biases")
            token_id, bias = pair
            if not (_is_int(token_id) and token_id >= 0):
                _fail("logit_bias", token_id, "keyed by token ids (integers >= 0)")
            if not (_is_real(bias) and low <= bias <= high):
                _fail("logit_bias", bias, f"biases in [{low:g}, {high:g}]")
        if len({token_id for token_id, _ in self.logit_bias}) != len(self.logit_bias):
            _fail("logit_bias", self.logit_bias, "one bias per token id")
        self._check_bad_words()
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if not 0 < len(allowed) <= MAX_TOKEN_LIST:
            _fail("allowed_token_ids", list(allowed), f"1 to {MAX_TOKEN_LIST} token ids")
        for token_id in allowed:
            if not (_is_int(token_id) and token_id >= 0):
                _fail("allowed_token_ids", token_id, "integers >= 0")
        if self.structured_outputs is not None:
            _fail("allowed_token_ids", allowed, "None with structured outputs (the grammar "
                  "decides which tokens may follow)")  # fmt: skip
        banned = {w[0] for w in self.bad_words_token_ids if len(w) == 1}
        if banned.issuperset(allowed):
            _fail("bad_words_token_ids", sorted(banned), "words that leave one of "
                  "allowed_token_ids to sample")  # fmt: skip

    def _check_bad_words(self) -> None:
        words = self.bad_words_token_ids
        if sum(len(w) if isinstance(w, tuple) else 1 for w in words) > MAX_TOKEN_LIST:
            _fail("bad_words_token_ids", len(words), f"at most {MAX_TOKEN_LIST} ids in all")
        for word in words:
            if not (isinstance(word, tuple) and word and all(_is_int(t) and t >= 0 for t in word)):
                _fail("bad_words_token_ids", word, "non-empty sequences of token ids (>= 0)")

    def banned_ids(self, output_token_ids: Sequence[int]) -> list[int]:
        """The ids its bad words forbid next, after ``output_token_ids``: each word's last id
        where the output ends with the rest of the word."""
        banned = []
        for word in self.bad_words_token_ids:
            head = len(word) - 1
            if head == 0 or (
                len(output_token_ids) >= head and tuple(output_token_ids[-head:]) == word[:-1]
            ):
                banned.append(word[-1])
        return banned

    def token_ids_over(self, vocab_size: int) -> tuple[str, int] | None:
        """The first (field, token id) of logit_bias / allowed_token_ids outside
        ``[0, vocab_size)``, None when every id is inside."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                return "logit_bias", token_id
        for token_id in self.allowed_token_ids or ():
            if token_id >= vocab_size:
                return "allowed_token_ids", token_id
        for word in self.bad_words_token_ids:
            for token_id in word:
                if token_id >= vocab_size:
                    return "bad_words_token_ids", token_id
        return None

    def vocab_error(self, vocab_size: int) -> tuple[str, str] | None:
        """(field, message) for a token id outside ``[0, vocab_size)``, None when all are
        inside: what the router (its tokenizer's vocabulary) and the engine (the model's)
        answer."""
        outside = self.token_ids_over(vocab_size)
        if outside is None:
            return None
        field, token_id = outside
        return field, f"'{field}' has token id {token_id}, outside the vocabulary [0, {vocab_size})"

    def fields_set(self) -> frozenset[str]:
        """The fields that differ from their defaults, beyond ``BASE_FIELDS``: the ones a
        worker must know to run this request as asked (``Register.sampling_fields``)."""
        return frozenset(
            name for name, default in _LATER_DEFAULTS if getattr(self, name) != default
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether logit_bias or allowed_token_ids change the logits before sampling."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def has_filters(self) -> bool:
        """Whether top_k, top_p or min_p can drop tokens."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float  # from the raw logits, before penalties and temperature
    rank: int  # 1 + number of tokens with a strictly higher logprob
    top: tuple[tuple[int, float], ...]  # (id, logprob), most likely first; () for logprobs=0


BASE_FIELDS = frozenset(
    (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "include_stop_str_in_output",
        "skip_special_tokens",
    )
)
"""The fields every kvrelay worker knows, from the first release of this wire format on.

A worker drops the trailing fields of a newer router's ``SamplingParams`` that it does not
know (the codec's rule for every message), which for sampling would run a request other than
the one asked for. So a worker lists the fields it knows when it registers
(``Register.sampling_fields``), and the router sends a request that sets a later field only to
workers that list it; a worker whose ``Register`` lacks the list (one older than the list)
is taken to know these alone."""

REQUEST_NAMES = {"bad_words_token_ids": "bad_words", "lora_name": "model"}
"""The HTTP request field a SamplingParams field comes from, where the names differ."""

FIELDS = tuple(f.name for f in fields(SamplingParams))
"""Every field this version knows, in wire order: what its workers register."""

_LATER_DEFAULTS = tuple(
    (f.name, f.default if f.default_factory is MISSING else f.default_factory())
    for f in fields(SamplingParams)
    if f.name not in BASE_FIELDS
)
