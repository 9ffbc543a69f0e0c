"""The tokenizer a GGUF file describes, rebuilt as Hugging Face tokenizer files.

A GGUF file holds no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges, the token
types and the special token ids as ``tokenizer.ggml.*`` metadata. ``build_tokenizer_files``
turns them into a ``tokenizers`` backend and the JSON files beside it, agreeing on token ids
with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``:

==================  ==============================================================
tokenizer.ggml.model  what it becomes
==================  ==============================================================
``gpt2``            byte-level BPE; the split regex follows ``tokenizer.ggml.pre``
``llama``           SentencePiece-style BPE with byte fallback (``▁`` for spaces)
==================  ==============================================================

Token types (``tokenizer.ggml.token_type``): 3 (control, e.g. ``<|im_start|>``) become special
added tokens, 4 (user-defined) plain added tokens, so neither is cut into pieces.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex that splits text before BPE (None: GPT-2's own).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": None,  # plus single digits, see _byte_level_pre_tokenizer
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPECIAL_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id"}
_EXTRA_EOS_IDS = ("eot_token_id", "eom_token_id")  # end of turn / of message: also stop


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported: the message names what is wrong."""


class Metadata:
    """The key/value metadata of a GGUF file, parsed into Python values."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)

    @classmethod
    def from_reader(cls, reader: Any) -> Metadata:
        """Parses every field of a ``gguf.GGUFReader``."""
        return cls({name: _field_value(f) for name, f in reader.fields.items()})

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self._values:
            raise GGUFImportError(f"the file has no {key!r} metadata")
        return self._values[key]

    def get_str(self, key: str) -> str:
        value = self.require(key)
        if not isinstance(value, str):
            raise GGUFImportError(f"metadata {key!r} is {value!r}, expected a string")
        return value

    def get_int(self, key: str, default: int | None = None) -> int:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFImportError(f"metadata {key!r} is {value!r}, expected an integer")
        return value

    def get_float(self, key: str, default: float | None = None) -> float:
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFImportError(f"metadata {key!r} is {value!r}, expected a number")
        return float(value)


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """Everything written beside the weights that concerns the tokenizer."""

    backend: Tokenizer  # tokenizer.json
    config: dict[str, Any]  # tokenizer_config.json
    chat_template: str | None  # chat_template.jinja
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    extra_eos_ids: tuple[int, ...] = field(default=())  # eot / eom ids

    @property
    def generation_config(self) -> dict[str, Any]:
        ids = (self.eos_token_id, *self.extra_eos_ids)
        eos = list(dict.fromkeys(i for i in ids if i is not None))
        config: dict[str, Any] = {"bos_token_id": self.bos_token_id}
        config["eos_token_id"] = eos if len(eos) > 1 else self.eos_token_id
        if self.pad_token_id is not None:
            config["pad_token_id"] = self.pad_token_id
        return config

    def write(self, out: Path) -> None:
        self.backend.save(str(out / "tokenizer.json"), pretty=True)
        _write_json(out / "tokenizer_config.json", self.config)
        _write_json(out / "generation_config.json", self.generation_config)
        if self.chat_template is not None:
            (out / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")


def build_tokenizer_files(meta: Metadata, model_max_length: int) -> TokenizerFiles:
    """The tokenizer files of a GGUF file's ``tokenizer.*`` metadata.

    Raises:
        GGUFImportError: no tokenizer, a tokenizer model other than gpt2 / llama, or
            inconsistent arrays.
    """
    kind = meta.get_str("tokenizer.ggml.model")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFImportError(f"{len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        tokens = [_byte_level_spelling(t) for t in tokens]
        backend = _byte_level_bpe(meta, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise GGUFImportError(
            f"unsupported tokenizer {kind!r} (tokenizer.ggml.model); supported: "
            "gpt2 (byte-level BPE), llama (SentencePiece BPE)"
        )
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_IDS.items()}
    ids["pad"] = meta.get("tokenizer.ggml.padding_token_id")
    for name, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFImportError(f"{name} token id {token_id} is outside the vocabulary")
    named = {n: tokens[i] for n, i in ids.items() if i is not None}
    _add_special_tokens(backend, tokens, types, kind, named)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(named, ids, add_bos, add_eos)
    config: dict[str, Any] = {f"{n}_token": t for n, t in named.items()}
    config.update(
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    extra = tuple(meta.get_int(f"tokenizer.ggml.{k}", -1) for k in _EXTRA_EOS_IDS)
    return TokenizerFiles(
        backend=backend,
        config=config,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        extra_eos_ids=tuple(i for i in extra if 0 <= i < len(tokens)),
    )


# ---- byte-level BPE (tokenizer.ggml.model == "gpt2") -----------------------------------------


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the characters from U+0100 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(0x100 + n) for n, b in enumerate(extra)})
    return table


def _byte_level_spelling(token: str) -> str:
    """A byte-level token as the BPE model spells it; llama.cpp stores a few special tokens
    in plain UTF-8 (characters outside the byte alphabet), which are re-spelled byte by byte."""
    alphabet = byte_alphabet()
    if set(token) <= _alphabet_chars():
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


@lru_cache(maxsize=1)
def _alphabet_chars() -> frozenset[str]:
    return frozenset(byte_alphabet().values())


def _byte_level_bpe(meta: Metadata, tokens: list[str]) -> Tokenizer:
    merges = [_merge_pair(m) for m in meta.require("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFImportError(f"the vocabulary repeats {len(tokens) - len(vocab)} token(s)")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        logger.warning("unknown tokenizer.ggml.pre %r: splitting text as GPT-2 does", pre)
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if pre == "smollm":  # llama.cpp: each digit alone, then GPT-2's regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise GGUFImportError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return left, right


# ---- SentencePiece-style BPE (tokenizer.ggml.model == "llama") -------------------------------


def _sentencepiece_bpe(meta: Metadata, tokens: list[str]) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [_merge_pair(m) for m in meta.require("tokenizer.ggml.merges")]
    else:
        scores = list(meta.require("tokenizer.ggml.scores"))
        merges = merges_from_scores(tokens, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies when the file lists none.

    Every way to cut a token into two tokens of the vocabulary is a merge ranked by the score
    of the token it makes, best first; ties go to the longer left piece, then the longer right
    piece, then vocabulary order (the order transformers and ``tokenizers`` use).
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores):
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in pairs)
    order = sorted(range(len(ranked)), key=lambda i: ranked[i][:3], reverse=True)
    # sorted(..., reverse=True) keeps equal keys in their original order, as wanted
    return [(ranked[i][3], ranked[i][4]) for i in order]


# ---- special tokens ----------------------------------------------------------------------------


def _add_special_tokens(
    backend: Tokenizer,
    tokens: list[str],
    types: list[int],
    kind: str,
    named: Mapping[str, str],
) -> None:
    """Control tokens (and the named bos/eos/unk/pad) as special added tokens, user-defined
    ones as plain added tokens. A byte-level control token spelled outside the byte alphabet
    is a llama.cpp mislabel and is left a normal token (as transformers does)."""
    alphabet = _alphabet_chars() if kind == "gpt2" else None
    special = [
        t
        for t, kind_id in zip(tokens, types)
        if kind_id == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if kind == "llama":
        special += [t for t in named.values() if t not in special]
    if special:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = backend.get_vocab(with_added_tokens=False)
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(
    named: Mapping[str, str], ids: Mapping[str, int | None], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """Adds bos / eos around each sequence when the file asks for it."""
    before = ["bos"] if add_bos and ids["bos"] is not None else []
    after = ["eos"] if add_eos and ids["eos"] is not None else []
    single = [named[n] for n in before] + ["$A"] + [named[n] for n in after]
    pair = [*single, *(f"{named[n]}:1" for n in before), "$B:1", *(f"{named[n]}:1" for n in after)]
    specials = [(named[n], ids[n]) for n in (*before, *after)]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
    )


# ---- metadata ------------------------------------------------------------------------------------


def _field_value(f: Any) -> Any:
    """A ``gguf.ReaderField`` as a Python value: a scalar, a string or a list of them."""
    from gguf import GGUFValueType

    def scalar(kind: Any, part: Any) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        return bool(value) if kind == GGUFValueType.BOOL else value

    if not f.types:
        return None
    if f.types[0] == GGUFValueType.ARRAY:
        if len(f.types) < 2 or f.types[1] == GGUFValueType.ARRAY:
            return []  # empty, or nested arrays: no Llama-family key has them
        return [scalar(f.types[1], f.parts[i]) for i in f.data]
    return scalar(f.types[0], f.parts[f.data[0]])


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
