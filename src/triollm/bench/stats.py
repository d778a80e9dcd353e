"""What one request measured, and what a level of load adds up to.

Pure: no I/O, no clocks. ``client.py`` fills a :class:`RequestRecord` per request
(times in seconds since the level started); :func:`summarise` turns a level's records
into one :class:`LevelSummary`, whose :meth:`LevelSummary.to_json` is one JSON line.

Definitions (the ones vLLM's ``bench serve`` and llama.cpp's server bench use):

- **TTFT**: request sent -> first chunk carrying output (text, or tokens the server
  counted).
- **TPOT** (time per output token): one request's ``(e2e - TTFT) / (tokens - 1)``,
  the tokens from ``usage``. It needs no chunk boundaries at all, so it is the same
  measure on every server however it packs its chunks.
- **ITL** (per token): a chunk that carried ``k`` tokens, ``gap`` seconds after the
  previous token-carrying chunk, adds ``k`` gaps of ``gap / k``. Why: a server holds
  back half a UTF-8 character (a CJK character is 3 byte-tokens) and sends the
  tokens in one chunk, so one gap between chunks spans ``k`` engine steps; counted
  as one gap it inflates the tail 2-3x, and differently on two servers that flush
  partial characters differently. The ``k - 1`` extra tokens of the *first* chunk
  add no gap (their time is inside TTFT). How ``k`` is known: the server says
  (llama-server's ``timings.predicted_n`` with ``timings_per_token``), else one token
  per chunk when the chunks add up to ``usage.completion_tokens``; otherwise the
  request's tokens cannot be placed and it is left out of ITL (counted as
  ``itl_unplaced``; TPOT still has it).
- **chunk gap**: the old, per-chunk ITL: the gaps between successive chunks,
  whatever each carried. Reported beside ITL, labelled as what it is.
- **stream tok/s**: one stream's decode rate, ``(tokens - 1) / (end - first token)``
  (``1 / TPOT``).
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
    # ignore_eos was sent, so the answer must be max_tokens long: a shorter (or longer)
    # one is not the work the other server was asked to do.
    NOT_MAX_TOKENS = "not max_tokens"
    DATA_AFTER_DONE = "data after [DONE]"


@dataclass(frozen=True)
class RequestRecord:
    """One request, as the client saw it. Times are seconds since the level started."""

    sent_s: float
    done_s: float
    outcome: Outcome
    status: int | None = None
    # Arrival time of every chunk that carried output: text, or tokens the server
    # counted (the first is the TTFT point).
    chunk_s: tuple[float, ...] = ()
    output_tokens: int = 0  # usage.completion_tokens, else the chunks counted
    # Tokens each chunk of chunk_s carried, when the server said so for every chunk
    # (llama-server's timings.predicted_n); () when it did not.
    chunk_tokens: tuple[int, ...] = ()
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
    def chunk_gap_s(self) -> list[float]:
        """The gaps between successive chunks, whatever each carried (the old ITL)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    @property
    def tokens_by_chunk(self) -> tuple[int, ...] | None:
        """How many tokens each chunk carried: the server's counts when they add up to
        ``output_tokens``; else one per chunk when there are as many chunks as tokens;
        else None (the tokens cannot be placed in their chunks)."""
        if self.chunk_tokens:
            ok = (
                len(self.chunk_tokens) == len(self.chunk_s)
                and sum(self.chunk_tokens) == self.output_tokens
            )
            return self.chunk_tokens if ok else None
        if self.chunk_s and len(self.chunk_s) == self.output_tokens:
            return (1,) * len(self.chunk_s)
        return None

    @property
    def itl_s(self) -> list[float] | None:
        """Per-token gaps (the module docstring's ITL); None when the tokens cannot be
        placed in their chunks."""
        counts = self.tokens_by_chunk
        if counts is None:
            return None
        out: list[float] = []
        prev: float | None = None
        for t, k in zip(self.chunk_s, counts, strict=True):
            if k == 0:  # text without a new token (a held-back tail): no step here
                continue
            if prev is not None:
                out += [(t - prev) / k] * k
            prev = t
        return out

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - TTFT) / (tokens - 1)``: the mean time per token after the first."""
        ttft = self.ttft_s
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.output_tokens - 1)

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
    itl_ms: dict[str, float | None]  # per token (module docstring)
    e2e_ms: dict[str, float | None]
    stream_tok_s: dict[str, float | None]
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    chunk_gap_ms: dict[str, float | None] = field(default_factory=dict)  # the old per-chunk ITL
    itl_unplaced: int = 0  # completed requests whose tokens could not be placed in chunks
    multi_token_chunks: int = 0  # chunks that carried more than one token (placed requests)
    token_chunks: int = 0  # chunks that carried at least one token (placed requests)
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
            # Runs before this field measured ITL per text chunk (now chunk_gap_ms).
            "itl_definition": "per token",
            "itl_ms": self.itl_ms,
            "tpot_ms": self.tpot_ms,
            "chunk_gap_ms": self.chunk_gap_ms,
            "itl_unplaced": self.itl_unplaced,
            "token_chunks": self.token_chunks,
            "multi_token_chunks": self.multi_token_chunks,
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
    itl: list[float] = []
    unplaced = multi = token_chunks = 0
    for r in ok:
        gaps, counts = r.itl_s, r.tokens_by_chunk
        if gaps is None or counts is None:
            unplaced += 1
            continue
        itl += gaps
        token_chunks += sum(1 for k in counts if k > 0)
        multi += sum(1 for k in counts if k > 1)
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
        tpot_ms=percentiles([t for r in ok if (t := r.tpot_s) is not None], 1e3),
        chunk_gap_ms=percentiles([g for r in ok for g in r.chunk_gap_s], 1e3),
        itl_unplaced=unplaced,
        multi_token_chunks=multi,
        token_chunks=token_chunks,
        ttft_by_turn_ms=by_turn,
        last_turn_ttft_ms=by_turn[str(turns[-1])] if turns else {},
    )
