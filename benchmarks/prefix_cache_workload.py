"""Prefix cache benchmark, workload and client: the deterministic multi-turn chats (one
shared system prompt) and the streaming client that sends them and records each turn."""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from kvrelay.text.tokenizer import Tokenizer


SERVED_NAME = "bench"
REQUEST_TIMEOUT_S = 600.0


class BenchError(RuntimeError):
    """A request failed or the cluster did not reach the state a configuration needs."""


# ---------------------------------------------------------------------------- workload

_PREAMBLE = "You are the support assistant of a software company. Follow these rules."
_RULES = (
    "Answer the question that was asked, and say so plainly when you do not know.",
    "Keep every reply short: two or three sentences are usually enough.",
    "When the user shares code, read all of it before you suggest a change.",
    "Prefer the standard library over a new dependency unless the user asks otherwise.",
    "Explain the reason for a change before you show the change itself.",
    "Never invent the output of a command that you did not run.",
    "Quote numbers with their units and say where they were measured.",
    "If a request is ambiguous, state the reading you chose and continue.",
    "Point out a risk to the user's data before any step that could lose it.",
    "Use the user's own names for files, functions and variables.",
    "Write dates as year, month and day, and times with their time zone.",
    "Summarise long answers in one sentence at the end.",
)
_TOPICS = (
    "How do I read a large file line by line without loading it into memory?",
    "Why does my program get slower when I add more threads?",
    "What is the difference between a process and a thread?",
    "How should I name the columns of a table that stores orders?",
    "Can you explain what a cache hit rate tells me about my service?",
    "Which is faster for lookups, a list or a dictionary, and why?",
    "How do I measure the latency of a web request from the client?",
    "What does it mean when a test passes alone but fails in the suite?",
    "How do I keep two services from using the same port on one machine?",
    "Why would a query use an index on one day and not on the next?",
)


@dataclass(frozen=True, slots=True)
class Workload:
    system_prompt: str
    num_system_tokens: int  # of the system prompt's text alone, with the model's tokenizer
    questions: tuple[tuple[str, ...], ...]  # [user][turn]
    mean_question_tokens: float  # of a question's text alone
    num_output_tokens: int

    @property
    def num_users(self) -> int:
        return len(self.questions)

    @property
    def num_turns(self) -> int:
        return len(self.questions[0])


def system_words() -> Iterator[str]:
    """An endless, deterministic stream of the system prompt's words (numbered rules)."""
    yield from _PREAMBLE.split()
    number = 0
    while True:
        for rule in _RULES:
            number += 1
            yield from f"Rule {number}: {rule}".split()


def build_system_prompt(tokenizer: Tokenizer, num_tokens: int) -> str:
    """The shortest prefix of ``system_words`` with at least ``num_tokens`` tokens."""

    def length(words: Sequence[str]) -> int:
        return len(tokenizer.encode(" ".join(words), add_special_tokens=False))

    words: list[str] = []
    stream = system_words()
    while length(words) < num_tokens:
        words.extend(next(stream) for _ in range(16))
    low, high = 1, len(words)  # binary search: the fewest words reaching num_tokens
    while low < high:
        mid = (low + high) // 2
        if length(words[:mid]) >= num_tokens:
            high = mid
        else:
            low = mid + 1
    return " ".join(words[:low])


def question(user: int, turn: int) -> str:
    rng = random.Random(f"user{user}-turn{turn}")
    first, second = rng.sample(_TOPICS, 2)
    return f"I am user {user + 1}, turn {turn + 1}. {first} Also: {second}"


def create_workload(model_dir: Path, args: argparse.Namespace) -> Workload:
    from kvrelay.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    text = build_system_prompt(tokenizer, args.system_tokens)
    questions = tuple(tuple(question(u, t) for t in range(args.turns)) for u in range(args.users))
    lengths = [len(tokenizer.encode(q, add_special_tokens=False)) for qs in questions for q in qs]
    return Workload(
        text,
        len(tokenizer.encode(text, add_special_tokens=False)),
        questions,
        sum(lengths) / len(lengths),
        args.output_tokens,
    )


# ---------------------------------------------------------------------------- client


@dataclass(frozen=True, slots=True)
class TurnResult:
    user: int
    turn: int
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    ttft_s: float
    e2e_s: float
    reply: str

    @property
    def num_computed_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens


def chat_body(messages: Sequence[dict[str, str]], num_output_tokens: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": list(messages),
        "max_tokens": num_output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_chat(
    client: httpx.Client, messages: Sequence[dict[str, str]], num_output_tokens: int
) -> tuple[str, float, float, dict[str, Any]]:
    """Streams one chat completion; returns the reply, TTFT and e2e seconds, and the usage.

    Raises:
        BenchError: an error status or event, or a stream without text, usage or ``[DONE]``.
    """
    start = time.perf_counter()
    ttft_s: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    body = chat_body(messages, num_output_tokens)
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise BenchError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                if ttft_s is None or usage is None:
                    raise BenchError(f"stream ended without text or usage: {usage}")
                return "".join(parts), ttft_s, time.perf_counter() - start, usage
            if not data:
                continue
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"error event: {data[:500]}")
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if ttft_s is None and (text or choice.get("finish_reason")):
                    ttft_s = time.perf_counter() - start
                parts.append(text)
            usage = event.get("usage") or usage
    raise BenchError("stream ended without [DONE]")


def run_workload(url: str, workload: Workload) -> list[TurnResult]:
    """Every turn of every user, one request at a time, turn-major (see the module doc)."""
    histories = [
        [{"role": "system", "content": workload.system_prompt}] for _ in workload.questions
    ]
    results = []
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for turn in range(workload.num_turns):
            for user, history in enumerate(histories):
                history.append({"role": "user", "content": workload.questions[user][turn]})
                reply, ttft_s, e2e_s, usage = stream_chat(
                    client, history, workload.num_output_tokens
                )
                history.append({"role": "assistant", "content": reply})
                results.append(
                    TurnResult(
                        user,
                        turn,
                        int(usage["prompt_tokens"]),
                        int(usage["prompt_tokens_details"]["cached_tokens"]),
                        dict(usage.get("kvrelay_cached_tokens_by_tier") or {}),
                        ttft_s,
                        e2e_s,
                        reply,
                    )
                )
    return results
