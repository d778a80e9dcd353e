"""Token ids in, client text out: the one text pipeline of the server and ``triollm generate``.

One :class:`TextStream` per request owns every rule between a sampled token id and
the text a client may see:

1. **A stop id ends the text and is not text.** EOS (or any stop token id) is never
   decoded into the answer; the text ends there, finish reason ``stop``.
2. **Complete text only.** The incremental detokenizer holds back half a UTF-8
   character or a pending word piece (``model/tokenizer.py``,
   :class:`~triollm.model.tokenizer.IncrementalDetokenizer`).
3. **Stop strings are held back across tokens.** A stop string can straddle two
   pieces, so matching each piece alone misses it, and matching only the final
   text would already have sent its first half. :class:`StopMatcher` holds back the
   longest suffix of the pending text that is a prefix of some stop string, and on a
   match releases the text up to the earliest stop string (OpenAI's rule: the stop
   sequence itself is not returned). The text ends there, finish reason ``stop``.
4. **The flushed tail can still complete a stop string.** At the end of a sequence
   the detokenizer's ``flush()`` may release text it held back; that tail goes
   through the matcher like any other piece, and a match there turns the finish
   reason into ``stop`` (it would otherwise be ``length``).
5. **vLLM's two stop options.** ``include_stop`` (``include_stop_str_in_output``)
   keeps the matched stop string at the end of the text. ``min_tokens``: no stop
   string counts before the answer holds that many tokens; the text of those first
   tokens goes straight out (a stop string that straddles the boundary is not
   matched, as in vLLM, which checks only from that token on). The stop *ids* are
   kept out of those tokens by the sampler (``batch.py``), so none arrives here.
6. **Tool calls are not text.** With a :class:`~triollm.toolcalls.ToolCallParser`
   (the request gave tools), what the stop matcher releases goes through it: the
   calls in the model's syntax come out as ``tool_calls`` pieces, the rest as text,
   and an answer that made a call and ended on its own finishes ``tool_calls``.

The interface is two calls, each returning a frozen :class:`TextPiece`::

    piece = text.push(token_id)        # per sampled token; piece.finish set: the text ended
    piece = text.finish(reason)        # once, when the scheduler ended the sequence

Read with ``output.py`` (``OutputProcessor._deliver``) and ``generate.py`` (``_drive``),
its two callers. Pure Python, no trio: the offline CLI imports it without the
server's dependencies, and ``tests/test_textstream.py`` tests it with plain sync
calls. A later stage (a tool-call parser, structured output) plugs in here, between
the detokenizer and the client, and adds fields to :class:`TextPiece`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from triollm.plan import FinishReason
from triollm.toolcalls import MARKERS, ToolCallDelta, ToolCallParser


class Detokenizer(Protocol):
    """What :class:`TextStream` needs from an incremental detokenizer."""

    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TextPiece:
    """The text one call released (possibly ``""`` while something is held back).

    ``finish`` is None while the text goes on; once set, the text has ended and
    nothing more may be pushed. From :meth:`TextStream.push` it is only ever
    ``STOP`` (a stop id or a stop string); from :meth:`TextStream.finish` it is the
    final reason.
    """

    text: str
    finish: FinishReason | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()  # pieces of calls parsed out of the text


class StopMatcher:
    """Holds back text that could still turn into a stop string; never emits one.

    :class:`TextStream`'s part for rule 3; usable alone on any stream of text.
    """

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include  # True: a matched stop string is part of the text
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string matched). After a
        match, stop feeding: the sequence is over."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(i, len(s)) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            # The earliest stop string wins (of two starting there, the shorter: it
            # completed first); it is cut off, or kept with ``include``.
            at, size = min(hits)
            out = self.pending[: at + size if self.include else at]
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """Everything held back (no stop string can complete any more)."""
        out, self.pending = self.pending, ""
        return out

    def finish(self, tail: str) -> tuple[str, bool]:
        """The end of the sequence: ``tail`` is the detokenizer's flush. Returns
        (the last text, whether a stop string matched in it): a match there
        still means finish reason ``stop``."""
        text, matched = self.feed(tail)
        return (text, True) if matched else (text + self.flush(), False)


class TextStream:
    """One request's text: the detokenizer, its stop ids and its stop strings.

    Trap: after a piece with ``finish`` set (from either call) the stream is over;
    a further call raises ``RuntimeError`` rather than emit text past the end.
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        *,
        stops: Sequence[str] = (),
        stop_ids: frozenset[int] = frozenset(),
        tools: ToolCallParser | None = None,
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special: bool = True,
    ) -> None:
        self._detok = detokenizer
        self._matcher = StopMatcher(stops, include=include_stop)
        # Rule 5: stop strings count from the min_tokens-th token on.
        self._min_tokens = min_tokens
        self._pushed = 0
        # Rule 6: with tools, the text past the stop matcher goes through the model
        # family's tool-call parser; calls become tool_calls, the rest stays text.
        self._tools = tools
        keep = getattr(detokenizer, "keep_special", None)  # test fakes have none
        if tools is not None and keep is not None:
            keep(MARKERS[tools.fmt])  # the parser must see its markers, special or not
        keep_all = getattr(detokenizer, "keep_every_special", None)
        if not skip_special and keep_all is not None:
            keep_all()  # skip_special_tokens false: every special token is text
        self.stop_ids = frozenset(stop_ids)
        self.finish_reason: FinishReason | None = None  # set once the text has ended

    def push(self, token_id: int) -> TextPiece:
        """One sampled token. ``finish`` is ``STOP`` when this token ended the text:
        a stop id (rule 1; the held-back tail is released with it) or a stop string
        (rule 3; what followed the stop string is dropped)."""
        self._check_open()
        if token_id in self.stop_ids:
            return self.finish(FinishReason.STOP)
        self._pushed += 1
        if self._pushed < self._min_tokens:  # rule 5: too early for a stop string
            text, matched = self._detok.push(token_id), False
        else:
            text, matched = self._matcher.feed(self._detok.push(token_id))
        if matched:
            return self._end(text, FinishReason.STOP)
        if self._tools is None:
            return TextPiece(text)
        parsed = self._tools.feed(text)
        return TextPiece(parsed.content, None, parsed.tool_calls)

    def finish(self, reason: FinishReason) -> TextPiece:
        """The sequence ended for ``reason`` (``length``, or ``stop`` on a stop id):
        release the held-back tail. The final reason is ``stop`` if that tail
        completed a stop string (rule 4), else ``reason``."""
        self._check_open()
        text, matched = self._matcher.finish(self._detok.flush())
        return self._end(text, FinishReason.STOP if matched else reason)

    def _end(self, text: str, reason: FinishReason) -> TextPiece:
        """The last piece. An answer that ended on its own after calling a tool ends
        with ``tool_calls`` (OpenAI's reason); cut by ``length`` it stays ``length``."""
        if self._tools is None:
            self.finish_reason = reason
            return TextPiece(text, reason)
        a, b = self._tools.feed(text), self._tools.finish()
        if self._tools.called and reason is FinishReason.STOP:
            reason = FinishReason.TOOL_CALLS
        self.finish_reason = reason
        return TextPiece(a.content + b.content, reason, a.tool_calls + b.tool_calls)

    def _check_open(self) -> None:
        if self.finish_reason is not None:
            raise RuntimeError(f"the text has already ended ({self.finish_reason.value})")
