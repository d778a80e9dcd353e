"""What the service tells the edge: the frozen stream events, and the hooks it calls.

The service -> edge counterpart of ``plan.py``: everything that crosses from the
batch loop to a request handler is one of these frozen values, sent over the
request's memory channel (:class:`Delta`, then one :class:`Ended` per choice) and
set once as each choice's outcome (:class:`Completed` | :class:`Failed`). The
:class:`Observer` is the other direction's interface: the metrics hooks the service
calls, which ``server/metrics.py`` implements. :class:`StepRecorder` keeps what each forward
pass computed, for tests and tools.

Read with ``service.py`` (which produces all of these) and ``server/responses.py``
(which turns them into OpenAI's JSON).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from triollm.outcomes import EndCode, Unfinished
from triollm.plan import FinishReason, StepPlan, StepResult
from triollm.toolcalls import ToolCallDelta

# --------------------------------------------------------------------------- stream events


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token with its log-probabilities (when the request asked).

    ``text`` and ``raw`` are how the token shows on its own and its own bytes, and
    ``top_text`` the same for each alternative in ``top``: the output processor fills
    them (``output.token_text``) before the edge reads the delta, so the edge shapes
    logprobs entries without a tokenizer. Empty until then.
    """

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    text: str = ""
    raw: bytes = b""
    top_text: tuple[tuple[str, bytes], ...] = ()
    # a scored prompt token's rank: 1 + how many tokens were likelier (None: not known)
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """New text for one request from one step (possibly empty while a stop string is
    held back) and the tokens that produced it."""

    text: str
    tokens: tuple[TokenInfo, ...]
    tool_calls: tuple[ToolCallDelta, ...] = ()  # pieces of tool calls (toolcalls.py)
    index: int = 0  # the choice it belongs to (OpenAI's ``index``; n > 1 has several)
    # A scored prompt (echo with logprobs): each prompt token with its log-probability
    # (the first one's is None: nothing predicts it), once, in each choice's first delta.
    prompt: tuple[TokenInfo, ...] = ()
    # Where each prompt token's text starts in the prompt's text (filled with the texts).
    prompt_offsets: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Completed:
    """The request finished normally. ``final`` is the last text (held-back text is
    flushed into it) and the last token."""

    finish_reason: FinishReason  # STOP or LENGTH
    final: Delta
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, those found in the prefix cache


@dataclass(frozen=True, slots=True)
class Failed:
    """The request ended early, for ``code``; ``message`` says why in words."""

    code: EndCode
    message: str
    prompt_tokens: int
    completion_tokens: int


Outcome = Completed | Failed


@dataclass(frozen=True, slots=True)
class Ended:
    """Choice ``index`` of a request has ended, with ``outcome``: on the request's
    channel after that choice's last :class:`Delta`, so a reader of several choices
    can close each one as it ends."""

    index: int
    outcome: Outcome


# --------------------------------------------------------------------------- the hooks


class StepKind(enum.Enum):
    """What a step computed, for its timing: decode rows only, or prompt rows too.

    Kept apart because they answer different questions: a decode step's time is the
    engine's share of a streamed token (set beside the client's inter-token latency,
    the rest is the server path's; docs/performance.md, "The server path"), a prefill
    step's is the first token's."""

    DECODE = "decode"
    PREFILL = "prefill"

    @classmethod
    def of(cls, prefill_rows: int) -> StepKind:
        return cls.PREFILL if prefill_rows else cls.DECODE


class Observer(Protocol):
    """The metrics hooks the service calls (``server/metrics.py`` provides them).

    ``admitted`` is called once per request (its prompt counted once, with its number
    of ``choices``); every other hook once per choice, each choice being a sequence.

    Trap: they run inside the batch loop; one that raises fails every request, so
    they take enums, never strings that could be misspelt."""

    def admitted(self, prompt_tokens: int, queue_seconds: float, choices: int = 1) -> None: ...
    def token(self, first: bool, seconds_since_previous: float) -> None: ...
    def finished(self, reason: FinishReason, e2e_seconds: float) -> None: ...
    def ended_early(self, reason: Unfinished) -> None: ...
    def step(self, rows: int, width: int, kind: StepKind, seconds: float) -> None: ...


class NullObserver:
    """An Observer that records nothing (a Service built without metrics)."""

    def admitted(self, prompt_tokens: int, queue_seconds: float, choices: int = 1) -> None:
        pass

    def token(self, first: bool, seconds_since_previous: float) -> None:
        pass

    def finished(self, reason: FinishReason, e2e_seconds: float) -> None:
        pass

    def ended_early(self, reason: Unfinished) -> None:
        pass

    def step(self, rows: int, width: int, kind: StepKind, seconds: float) -> None:
        pass


# --------------------------------------------------------------------------- the step recorder


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    rows: int
    width: int  # sequences in the forward pass
    prefill_rows: int
    decode_rows: int
    seq_ids: tuple[int, ...]
    seconds: float


class StepRecorder:
    """The last ``capacity`` steps: what each forward pass computed, and for whom.

    Tests read batch width from here instead of from a clock ("two requests shared
    a forward pass" is ``width >= 2`` on some step holding both ids).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.records: deque[StepRecord] = deque(maxlen=capacity)
        self.total_steps = 0

    def record(self, plan: StepPlan, result: StepResult) -> StepRecord:
        rec = StepRecord(
            step=plan.step,
            rows=plan.n_rows,
            width=len(plan.chunks),
            prefill_rows=sum(c.n_rows for c in plan.chunks if c.prefill),
            decode_rows=sum(c.n_rows for c in plan.chunks if not c.prefill),
            seq_ids=tuple(c.seq_id for c in plan.chunks),
            seconds=result.seconds,
        )
        self.records.append(rec)
        self.total_steps += 1
        return rec

    def shared(self, a: int, b: int) -> bool:
        """Whether sequences ``a`` and ``b`` ever ran in the same forward pass."""
        return any(a in r.seq_ids and b in r.seq_ids for r in self.records)

    @property
    def max_width(self) -> int:
        return max((r.width for r in self.records), default=0)
