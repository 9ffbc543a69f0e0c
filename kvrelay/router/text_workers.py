"""Tokenization and chat templating off the router's event loop.

The loop serves every request, the heartbeats of every worker and ``/health``; CPU work on a
large input must not hold it. Measured on a 3.9 MB prompt (``benchmarks/router_health.py``,
DESIGN.md "Router event loop"):

=================  ==========  =========================================================
work               where       why
=================  ==========  =========================================================
short text         inline      under ``INLINE_CHARS`` the call is shorter than a hop
encode <= 256 Ki   thread      ``tokenizers`` releases the GIL while it encodes; it holds
                               it ~0.3 s per 3.9 MB while it builds the result, which
                               is ~20 ms at 256 Ki characters
encode > 256 Ki    process     that tail would stall the loop; a child process encodes
                               and sends the ids back as packed bytes
chat template      thread      jinja holds the GIL but yields it every switch interval
                               (5 ms); 49 ms for 3.9 MB, no gap over ~10 ms
=================  ==========  =========================================================

The process pool (one ``spawn``ed child, which loads the tokenizer from the checkpoint
directory) starts with the router (``start()``), so its start never stalls a request; a
tokenizer built in memory (tests) has no directory and uses the thread for every size.

``encode(..., limit=N)`` raises ``PromptTooLong`` when the text has N tokens or more: the
child then sends back only the count, so a prompt far over the context window never becomes
a million-element list on the router (building and freeing it holds the GIL for tens of ms).
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvrelay.text.tokenizer import Tokenizer

INLINE_CHARS = 16_384  # shorter texts are encoded on the loop
PROCESS_CHARS = 262_144  # longer texts are encoded in the child process
PARENT_CHECK_S = 1.0  # how often the child checks that its router still lives

_child_tokenizer: Tokenizer | None = None


class PromptTooLong(Exception):
    """The text has at least the ``limit`` given to ``encode``: ``num_tokens`` of them."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


class TextWorkers:
    """Encodes and renders chat templates without blocking the event loop."""

    def __init__(self, tokenizer: Tokenizer, model_dir: str | Path | None = None) -> None:
        self.tokenizer = tokenizer
        self._model_dir = None if model_dir is None else str(model_dir)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Starts the child process now (it loads the tokenizer meanwhile), if there is one."""
        if self._model_dir is not None:
            self._process_pool().submit(_encode_in_child, "", False, None)

    async def encode(
        self, text: str, add_special_tokens: bool, limit: int | None = None
    ) -> list[int]:
        """Token ids of ``text``; raises what ``Tokenizer.encode`` raises, and PromptTooLong
        when there are ``limit`` or more."""
        if len(text) <= INLINE_CHARS:
            ids = self.tokenizer.encode(text, add_special_tokens)
        elif len(text) <= PROCESS_CHARS or self._model_dir is None:
            ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        else:
            loop = asyncio.get_running_loop()
            packed = await loop.run_in_executor(
                self._process_pool(), _encode_in_child, text, add_special_tokens, limit
            )
            if isinstance(packed, int):
                raise PromptTooLong(packed)
            return await asyncio.to_thread(_unpack, packed)
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(len(ids))
        return ids

    async def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        """The rendered chat; in a thread when the messages are long."""
        size = sum(len(str(m.get("content") or "")) for m in messages)
        render = self.tokenizer.apply_chat_template
        if size <= INLINE_CHARS:
            return render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return await asyncio.to_thread(
            lambda: render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        )

    def _process_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        assert self._model_dir is not None, "encode() uses the pool only with a directory"
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_child,
                initargs=(self._model_dir, os.getpid()),
            )
        return self._pool

    def close(self) -> None:
        """Ends the child, waiting for it (at most the one call it runs). Not waiting raced
        the interpreter's exit: the executor's thread closing its wake-up pipe while
        ``concurrent.futures``' exit hook wrote to it printed an ``OSError: [Errno 9]``
        traceback at the end of a router's log."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _init_child(model_dir: str, parent_pid: int) -> None:
    global _child_tokenizer
    _child_tokenizer = Tokenizer.from_pretrained(model_dir)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    """Ends the child once its router is gone. A router killed with SIGKILL never shuts the
    pool down, and the child, blocked on the pool's call queue, would otherwise live on."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _encode_in_child(text: str, add_special_tokens: bool, limit: int | None) -> bytes | int:
    """The ids as packed uint32, or only their count when it reaches ``limit``."""
    assert _child_tokenizer is not None, "the pool's initializer loads the tokenizer"
    ids = _child_tokenizer.encode_without_offsets(text, add_special_tokens)
    if limit is not None and len(ids) >= limit:
        return len(ids)
    return array.array("I", ids).tobytes()


def _unpack(packed: bytes) -> list[int]:
    ids = array.array("I")
    ids.frombytes(packed)
    return ids.tolist()
