"""Request traces: the Splitwise CSVs and aiperf's mooncake JSONL, parsed into one shape.

=========  ==============================================  ==================================
format     a line                                          arrival
=========  ==============================================  ==================================
splitwise  ``TIMESTAMP,ContextTokens,GeneratedTokens``      ``2023-11-16 18:17:03.9799600``
           (a header line first)                           (wall clock; any digits of seconds)
mooncake   ``{"timestamp": 27482, "input_length": 6955,     ``timestamp`` in milliseconds
           "output_length": 52, "hash_ids": [46, 47]}``
=========  ==============================================  ==================================

Arrivals are made relative to the first request (it arrives at 0 s). ``hash_ids`` (optional)
name the prompt's blocks of ``MOONCAKE_BLOCK_TOKENS`` tokens: equal ids are equal content, so
they carry the trace's own prefix sharing. A malformed line raises ``TraceError`` naming the
file and the line. Only the standard library is used (``kvrelay bench`` imports this).
"""

from __future__ import annotations

import csv
import datetime
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

TraceFormat = Literal["splitwise", "mooncake"]
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in mooncake traces
SPLITWISE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class TraceRequest(NamedTuple):
    arrival_s: float  # seconds after the trace's first request
    prompt_len: int  # tokens
    output_len: int  # tokens to generate (forced: eos ignored)
    hash_ids: tuple[int, ...] = ()  # mooncake: ids of the prompt's 512-token blocks


def detect_format(path: Path) -> TraceFormat:
    """``mooncake`` for ``.jsonl`` / ``.json`` files, else ``splitwise``."""
    return "mooncake" if path.suffix in (".jsonl", ".json") else "splitwise"


def load_trace(path: str | Path, fmt: TraceFormat | None = None) -> list[TraceRequest]:
    """Every request of a trace file, in arrival order.

    Raises:
        TraceError: the file is missing, empty or has a malformed line (named).
    """
    path = Path(path)
    fmt = fmt or detect_format(path)
    try:
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(
                _parse_splitwise(f, path) if fmt == "splitwise" else _parse_mooncake(f, path)
            )
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None
    if not rows:
        raise TraceError(f"{path}: no requests in the trace")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [r._replace(arrival_s=r.arrival_s - start) for r in rows]


def _parse_splitwise(lines: Iterator[str], path: Path) -> Iterator[TraceRequest]:
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != SPLITWISE_COLUMNS:
        raise TraceError(
            f"{path}:1: expected the header {','.join(SPLITWISE_COLUMNS)}, got {header}"
        )
    for row in reader:
        where = f"{path}:{reader.line_num}"
        if not row:
            continue
        if len(row) != 3:
            raise TraceError(f"{where}: expected 3 fields, got {len(row)}: {row}")
        yield TraceRequest(
            _timestamp_s(row[0], where),
            _count(row[1], "ContextTokens", where, low=1),
            _count(row[2], "GeneratedTokens", where, low=0),
        )


def _parse_mooncake(lines: Iterator[str], path: Path) -> Iterator[TraceRequest]:
    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{num}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg}): {line.strip()[:100]}") from None
        if not isinstance(item, dict):
            raise TraceError(f"{where}: expected an object, got {line.strip()[:100]}")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in item:
                raise TraceError(f"{where}: missing {key!r}")
        stamp = item["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp < 0:
            raise TraceError(f"{where}: timestamp must be milliseconds >= 0, got {stamp!r}")
        hash_ids = item.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
        ):
            raise TraceError(f"{where}: hash_ids must be a list of integers, got {hash_ids!r}")
        yield TraceRequest(
            stamp / 1000.0,
            _count(item["input_length"], "input_length", where, low=1),
            _count(item["output_length"], "output_length", where, low=0),
            tuple(hash_ids),
        )


def _count(value: object, name: str, where: str, low: int) -> int:
    if isinstance(value, str):
        value = value.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(f"{where}: {name} must be an integer >= {low}, got {value!r}")
    return value


def _timestamp_s(text: str, where: str) -> float:
    """``YYYY-MM-DD HH:MM:SS[.fraction]`` -> seconds since the epoch (UTC, any fraction digits)."""
    day, _, clock = text.strip().partition(" ")
    try:
        date = datetime.date.fromisoformat(day)
        hours, minutes, seconds = clock.split(":")
        secs = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        raise TraceError(
            f"{where}: bad TIMESTAMP {text!r} (want YYYY-MM-DD HH:MM:SS.ffff)"
        ) from None
    return (date.toordinal() - 719163) * 86400 + secs


def cap_requests(
    requests: Sequence[TraceRequest],
    max_requests: int | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    time_scale: float = 1.0,
) -> list[TraceRequest]:
    """The first ``max_requests``, lengths capped, arrival gaps multiplied by ``time_scale``
    (2.0: half the rate). A capped prompt keeps its leading hash ids only."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    out = []
    for r in requests[:max_requests]:
        prompt_len = min(r.prompt_len, max_prompt_tokens or r.prompt_len)
        output_len = min(r.output_len, max_output_tokens or r.output_len)
        num_ids = -(-prompt_len // MOONCAKE_BLOCK_TOKENS)
        out.append(
            TraceRequest(
                r.arrival_s * time_scale, prompt_len, max(1, output_len), r.hash_ids[:num_ids]
            )
        )
    return out
