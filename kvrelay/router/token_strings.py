"""Each token's text and bytes as a response's logprobs show them (vLLM's strings).

``TokenStrings`` gives a token's text, and for a token that is part of a multi-byte
character its bytes spelled as ``bytes:\\xNN``; ``clamped`` keeps a logprob in JSON's
range (``MIN_LOGPROB``).
"""

from __future__ import annotations

from functools import lru_cache

from kvrelay.text.tokenizer import REPLACEMENT_CHAR, Tokenizer, TokenizerError

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to this too


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE symbol char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenStrings:
    """Per-token text and bytes for logprobs, as vLLM reports them (cached per id).

    ``text`` is the token decoded on its own. ``utf8`` is its UTF-8 bytes, except that a
    byte-level BPE token holding part of a character (its text is U+FFFD) gives its true bytes.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def utf8(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            entry = (text, self._true_bytes(token_id, text))
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = entry
        return entry

    def _true_bytes(self, token_id: int, text: str) -> list[int]:
        if REPLACEMENT_CHAR in text:
            try:
                symbol = self._tokenizer.convert_ids_to_tokens(token_id)
            except TokenizerError:
                symbol = ""
            decoder = _byte_decoder()
            if symbol and all(c in decoder for c in symbol):
                return [decoder[c] for c in symbol]
        return list(text.encode("utf-8", errors="replace"))


def clamped(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN
