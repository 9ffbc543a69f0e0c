"""Incremental text for one request, with stop strings.

While a request runs, text that could still be the start of a stop string is held back
(at most ``longest stop - 1`` characters), so a streamed delta never has to be retracted.
When a stop string appears the text is cut at it (or after it, with
``include_stop_str_in_output``) and the request finishes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.text.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from kvrelay.protocol.sampling_params import SamplingParams
    from kvrelay.text.tokenizer import Tokenizer


class StopChecker:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """``output_token_ids``: tokens the request already has, made and shown elsewhere (a
        decode worker's import, a re-run): their text counts as shown, and a stop string
        that begins in it and ends in a new token is found."""
        self._detok = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self._stops = params.stop
        self._include = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._num_emitted = 0
        self._num_tokens = len(output_token_ids or ())
        if self._detok is not None and output_token_ids:
            self._text = self._detok.step(list(output_token_ids))
            self._num_emitted = len(self._text)

    @property
    def text(self) -> str:
        """All text so far (cut at the stop string once one is found)."""
        return self._text

    def append(self, token_id: int, finished: bool) -> tuple[str, str | None]:
        """Adds one token; returns the text that may be shown now and the stop string hit."""
        self._num_tokens += 1
        if self._detok is None:
            return "", None
        search_from = max(0, len(self._text) - self._hold)
        self._text += self._detok.step([token_id])
        if finished:
            self._text += self._detok.flush()  # a last, incomplete character
        if self._stops and self._num_tokens >= self._min_tokens:
            hit = self._find_stop(search_from)
            if hit is not None:
                index, stop = hit
                self._text = self._text[: index + len(stop) if self._include else index]
                return self.flush(), stop
        limit = len(self._text) if finished else len(self._text) - self._hold
        if limit <= self._num_emitted:
            return "", None
        new = self._text[self._num_emitted : limit]
        self._num_emitted = limit
        return new, None

    def flush(self) -> str:
        """Text not yet shown (held back for a possible stop string)."""
        new = self._text[self._num_emitted :]
        self._num_emitted = len(self._text)
        return new

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best
