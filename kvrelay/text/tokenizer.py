"""Tokenizer of a Hugging Face checkpoint directory, its chat template, and streaming decode.

Reads the files transformers reads (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json``) and agrees with ``AutoTokenizer`` on token
ids and on rendered chat templates. Imports neither torch nor transformers: the router uses it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, overload

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# The named special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or input the tokenizer or chat template rejects."""


class Tokenizer:
    """Byte-level or sentencepiece-style tokenizer backed by the ``tokenizers`` library.

    Immutable after construction; safe to share between threads.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wraps a loaded backend.

        Args:
            backend: the ``tokenizers.Tokenizer`` (from ``tokenizer.json``).
            config: the parsed ``tokenizer_config.json``.
            generation_config: the parsed ``generation_config.json`` (extra eos ids).
            chat_template: jinja2 source of the chat template, if the model has one.
        """
        config = config or {}
        generation_config = generation_config or {}
        self._backend = backend
        self._backend.no_padding()
        self._backend.no_truncation()
        self._named_tokens = {
            name: token
            for name in NAMED_SPECIAL_TOKENS
            if (token := _token_content(config.get(name))) is not None
        }
        self._bos_token_id = self._named_id("bos_token", generation_config.get("bos_token_id"))
        self._pad_token_id = self._named_id("pad_token", generation_config.get("pad_token_id"))
        eos_ids = [self._named_id("eos_token", None)]
        eos_ids += _as_id_list(generation_config.get("eos_token_id"))
        self._eos_token_ids = frozenset(i for i in eos_ids if i is not None)
        self._all_special_ids = self._collect_special_ids()
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._pair_template = _pair_template(backend)  # join_pair's specials

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Loads the tokenizer files of a checkpoint directory.

        Raises:
            TokenizerError: ``tokenizer.json`` is missing or unreadable, or a JSON file is invalid.
        """
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        return cls(
            _load_backend(model_dir / "tokenizer.json"),
            config,
            _read_json(model_dir / "generation_config.json"),
            _read_chat_template(model_dir, config),
        )

    # ---- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The eos token of tokenizer_config.json and every eos id of generation_config.json."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of special added tokens, of the named (bos/eos/pad/...) tokens and the eos ids."""
        return self._all_special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...

    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Token strings (byte-level form for BPE) of one id or of a sequence of ids.

        Raises:
            TokenizerError: an id is outside the vocabulary.
        """
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(i) for i in ids]

    # ---- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor adds bos/eos.

        As in transformers 5, ``tokenizer.json``'s post-processor decides which special tokens
        are added; ``add_bos_token``/``add_eos_token`` in tokenizer_config.json are ignored.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_without_offsets(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode``'s ids, ~4x faster on a long text: the backend's batch call that skips the
        character offsets ``encode`` computes and drops (3.9 MB: 2.0 s against 7.8 s). A
        batch call may start the backend's thread pool, which a later fork disables with a
        warning: for processes that do not fork (the router's tokenizer child)."""
        encodings = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encodings[0].ids

    def join_pair(self, first: Sequence[int], second: Sequence[int]) -> list[int]:
        """The ids of a text pair (a cross-encoder's query and document) from each text's ids
        encoded without special tokens: what ``tokenizer(text, text_pair)`` gives, the
        post-processor's pair template (its separators) around them. Plain concatenation when
        the tokenizer has no pair template."""
        before, between, after = self._pair_template
        return [*before, *first, *between, *second, *after]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD; unknown ids are dropped."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` with the model's chat template, as transformers does.

        Text parts of list-valued ``content`` are joined with newlines first. Extra keyword
        arguments become template variables and override the named special tokens.
        ``chat_template`` replaces the model's template for this call (sandboxed like it).

        Raises:
            TokenizerError: no chat template, a malformed message, or the template failed.
        """
        template = self._template() if chat_template is None else _compile(chat_template)
        variables: dict[str, Any] = {
            **self._named_tokens,
            **kwargs,
            "messages": [_normalize_message(m, i) for i, m in enumerate(messages)],
            "tools": [dict(t) for t in tools] if tools is not None else None,
            "documents": kwargs.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own bos, so none is added."""
        rendered = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(rendered, add_special_tokens=False)

    # ---- internals -----------------------------------------------------------------------------

    def _collect_special_ids(self) -> frozenset[int]:
        added = {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        named = {self._backend.token_to_id(token) for token in self._named_tokens.values()}
        return frozenset(added | {i for i in named if i is not None} | self._eos_token_ids)

    def _named_id(self, name: str, fallback: Any) -> int | None:
        token = self._named_tokens.get(name)
        token_id = self._backend.token_to_id(token) if token is not None else None
        if token_id is None and fallback is not None:
            ids = _as_id_list(fallback)
            token_id = ids[0] if ids else None
        return token_id

    def _id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary")
        return token

    def _template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise TokenizerError("this model has no chat template")
        if self._compiled_template is None:
            try:
                self._compiled_template = _create_jinja_env().from_string(self._chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"chat template does not compile: {exc}") from exc
        return self._compiled_template


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, one ``step`` at a time.

    Keeps a small window of already-decoded tokens (``prefix_offset`` .. ``read_offset``) and
    decodes only the window plus the new tokens, emitting the difference. A decoded tail that
    ends in U+FFFD may be an incomplete UTF-8 character, so that one character is held back
    until a later token completes it. For lossy UTF-8 decoding only the last character of a
    text can change when bytes are appended, so everything before it is emitted at once.

        ids:   [... emitted ...| prefix window | held (not yet complete) ]
                               ^prefix_offset  ^read_offset               ^len(ids)

    The concatenated deltas equal ``tokenizer.decode(output_ids)`` for byte-level tokenizers
    (after ``flush`` when the output ends inside a character).
    """

    _NUM_PROMPT_CONTEXT_TOKENS = 4  # prompt tokens decoded as context for the first output token
    _MAX_HELD_TOKENS = 16  # emit anyway past this many tokens without a complete character

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-self._NUM_PROMPT_CONTEXT_TOKENS :])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            context, context_text = [], ""
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_len = len(context_text)
        self._num_held_emitted = 0  # chars of the held tokens' text already emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._pieces)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Appends new output tokens and returns the text they complete (possibly empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        window_text = self._decode(self._ids[self._prefix_offset :])
        num_held = len(self._ids) - self._read_offset
        if not window_text.endswith(REPLACEMENT_CHAR) or num_held > self._MAX_HELD_TOKENS:
            return self._emit_all(window_text)
        start = self._prefix_len + self._num_held_emitted
        delta = window_text[start:-1]
        self._num_held_emitted += len(delta)
        return self._record(delta)

    def flush(self) -> str:
        """Emits whatever is held back (an incomplete character becomes U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit_all(self._decode(self._ids[self._prefix_offset :]))

    def _emit_all(self, window_text: str) -> str:
        delta = window_text[self._prefix_len + self._num_held_emitted :]
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))
        self._num_held_emitted = 0
        return self._record(delta)

    def _record(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """A chat template given with a request (the last few are kept compiled)."""
    try:
        return _create_jinja_env().from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


def _create_jinja_env() -> ImmutableSandboxedEnvironment:
    """A sandboxed environment with the settings and helpers transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _normalize_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Drops keys whose value is None and joins list-valued content into one string."""
    if not isinstance(message, Mapping):
        raise TokenizerError(f"message {index} must be an object, got {type(message).__name__}")
    normalized = {key: value for key, value in message.items() if value is not None}
    content = normalized.get("content")
    if isinstance(content, list):
        normalized["content"] = "\n".join(_text_part(part, index) for part in content)
    elif content is not None and not isinstance(content, str):
        raise TokenizerError(
            f"message {index}: content must be a string or a list of parts, "
            f"got {type(content).__name__}"
        )
    return normalized


def _text_part(part: Any, index: int) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise TokenizerError(f"message {index}: unsupported content part type {kind!r}")
    text = part.get("text")
    if not isinstance(text, str):
        raise TokenizerError(f"message {index}: a text part needs a string 'text'")
    return text


def _pair_template(backend: BackendTokenizer) -> tuple[list[int], list[int], list[int]]:
    """The special ids the post-processor puts before, between and after a pair's texts."""
    joined = backend.encode("a", "b", add_special_tokens=True)
    parts: tuple[list[int], list[int], list[int]] = ([], [], [])
    part = 0
    for token_id, seq in zip(joined.ids, joined.sequence_ids):
        if seq is None:
            parts[part].append(token_id)
        else:  # past text 0: between; past text 1: after
            part = seq + 1
    return parts


def _load_backend(path: Path) -> BackendTokenizer:
    if not path.is_file():
        raise TokenizerError(f"missing tokenizer file: {path}")
    try:
        return BackendTokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a plain Exception
        raise TokenizerError(f"cannot load {path}: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    """The object in ``path``, or an empty dict when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return value


def _read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` (transformers 5) wins over ``tokenizer_config.json``'s template."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str | None:
    """A special token's text, from a string or a serialized AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
