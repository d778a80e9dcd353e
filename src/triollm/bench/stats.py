"""What one request measured, and what a level of load adds up to.

Pure: no I/O, no clocks. ``client.py`` fills a :class:`RequestRecord` per request
(times in seconds since the level started); :func:`summarise` turns a level's records
into one :class:`LevelSummary`, whose :meth:`LevelSummary.to_json` is one JSON line.

Definitions (the ones vLLM's ``bench serve`` and llama.cpp's server bench use):

- **TTFT**: request sent -> first chunk carrying text.
- **ITL**: the gaps between successive text-carrying chunks of one stream. A server
  that packs several tokens into one chunk shows fewer, longer gaps; the token count
  for throughput comes from ``usage`` when the server sends it.
- **stream tok/s**: one stream's decode rate, ``(tokens - 1) / (end - first token)``.
- **aggregate tok/s**: every output token of the level / the level's wall time (first
  request sent -> last one done).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


class Outcome(enum.Enum):
    """How a request ended, as the status table counts it."""

    OK = "200"  # a 200 stream that reached its finish_reason
    RATE_LIMITED = "429"
    CLIENT_ERROR = "4xx"
    SERVER_ERROR = "5xx"
    CUT = "cut"  # a 200 stream that ended (or broke) before its finish_reason
    NO_CONNECTION = "no connection"  # refused, reset before a status, or timed out


class Problem(enum.Enum):
    """A protocol fault the client saw; any of them means the server misbehaved."""

    NO_DONE = "no [DONE]"  # the stream ended without its terminating ``data: [DONE]``
    ERROR_EVENT = "error event"  # an SSE event carrying ``{"error": ...}``
    BAD_EVENT = "unparsable event"  # not JSON, or JSON without ``choices``
    USAGE_MISSING = "usage missing"  # include_usage was asked for and never came
    USAGE_MISMATCH = "usage disagrees"  # usage vs the tokens that arrived / were sent
    DATA_AFTER_DONE = "data after [DONE]"


@dataclass(frozen=True)
class RequestRecord:
    """One request, as the client saw it. Times are seconds since the level started."""

    sent_s: float
    done_s: float
    outcome: Outcome
    status: int | None = None
    # Arrival time of every chunk that carried text (the first is the TTFT point).
    chunk_s: tuple[float, ...] = ()
    output_tokens: int = 0  # usage.completion_tokens, else the text chunks counted
    prompt_tokens: int | None = None  # usage.prompt_tokens when reported
    finish_reason: str | None = None
    retry_after: str | None = None  # the Retry-After header of a 429
    problems: tuple[tuple[Problem, str], ...] = ()  # (kind, detail)
    turn: int = 0  # 1-based turn of a multi-turn conversation; 0 = single request
    text: str = ""  # the streamed text (a multi-turn chat sends it back next turn)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    @property
    def stream_tok_s(self) -> float | None:
        if self.output_tokens < 2 or not self.chunk_s or self.done_s <= self.chunk_s[0]:
            return None
        return (self.output_tokens - 1) / (self.done_s - self.chunk_s[0])


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50/p90/p99 and the mean of ``values`` (times ``scale``); Nones when empty."""
    if not values:
        empty: dict[str, float | None] = {f"p{p}": None for p in PERCENTILES}
        return empty | {"mean": None}
    a = np.asarray(values, dtype=np.float64) * scale
    out: dict[str, float | None] = {
        f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True)
    }
    out["mean"] = float(a.mean())
    return out


@dataclass(frozen=True)
class LevelSummary:
    """One level of load (a concurrency or a rate): the figures a table row shows."""

    requests: int
    by_outcome: dict[str, int]
    retry_after: dict[str, int]  # the Retry-After values the 429s carried
    problems: dict[str, int]
    problem_examples: dict[str, str]
    duration_s: float
    output_tokens: int
    aggregate_tok_s: float
    request_rate: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    stream_tok_s: dict[str, float | None]
    # Multi-turn chats only: TTFT per turn number, and the last turn's on its own
    # (the figure prefix caching should shrink). Empty for single requests.
    ttft_by_turn_ms: dict[str, dict[str, float | None]] = field(default_factory=dict)
    last_turn_ttft_ms: dict[str, float | None] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return self.by_outcome.get(Outcome.OK.value, 0)

    @property
    def problem_count(self) -> int:
        return sum(self.problems.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.ok,
            "by_outcome": self.by_outcome,
            "retry_after": self.retry_after,
            "problems": self.problems,
            "problem_examples": self.problem_examples,
            "duration_s": self.duration_s,
            "output_tokens": self.output_tokens,
            "aggregate_tok_s": self.aggregate_tok_s,
            "request_rate": self.request_rate,
            "ttft_ms": self.ttft_ms,
            "itl_ms": self.itl_ms,
            "e2e_ms": self.e2e_ms,
            "stream_tok_s": self.stream_tok_s,
            "ttft_by_turn_ms": self.ttft_by_turn_ms,
            "last_turn_ttft_ms": self.last_turn_ttft_ms,
        }


def summarise(records: Sequence[RequestRecord]) -> LevelSummary:
    """Add up one level. Latencies count only requests that completed (OK); tokens
    count every token that arrived, cut streams included, because the server spent
    the compute on them."""
    outcomes = Counter(r.outcome.value for r in records)
    ok = [r for r in records if r.outcome is Outcome.OK]
    problems: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for r in records:
        for kind, detail in r.problems:
            problems[kind.value] += 1
            examples.setdefault(kind.value, detail)
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.done_s for r in records), default=0.0)
    duration = end - start
    tokens = sum(r.output_tokens for r in records)
    itl = [g for r in ok for g in r.itl_s]
    turns = sorted({r.turn for r in ok if r.turn})
    by_turn = {
        str(t): percentiles([r.ttft_s for r in ok if r.turn == t and r.ttft_s is not None], 1e3)
        for t in turns
    }
    return LevelSummary(
        requests=len(records),
        by_outcome=dict(sorted(outcomes.items())),
        retry_after=dict(
            Counter(r.retry_after or "(none)" for r in records if r.outcome is Outcome.RATE_LIMITED)
        ),
        problems=dict(sorted(problems.items())),
        problem_examples=examples,
        duration_s=duration,
        output_tokens=tokens,
        aggregate_tok_s=tokens / duration if duration > 0 else 0.0,
        request_rate=len(ok) / duration if duration > 0 else 0.0,
        ttft_ms=percentiles([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        itl_ms=percentiles(itl, 1e3),
        e2e_ms=percentiles([r.e2e_s for r in ok], 1e3),
        stream_tok_s=percentiles([s for r in ok if (s := r.stream_tok_s) is not None]),
        ttft_by_turn_ms=by_turn,
        last_turn_ttft_ms=by_turn[str(turns[-1])] if turns else {},
    )
