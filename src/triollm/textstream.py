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

The interface is two calls, each returning a frozen :class:`TextPiece`::

    piece = text.push(token_id)        # per sampled token; piece.finish set: the text ended
    piece = text.finish(reason)        # once, when the scheduler ended the sequence

Read with ``service.py`` (``Service._deliver``) and ``generate.py`` (``_drive``),
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


class StopMatcher:
    """Holds back text that could still turn into a stop string; never emits one.

    :class:`TextStream`'s part for rule 3; usable alone on any stream of text.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string matched). After a
        match, stop feeding: the sequence is over."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.pending[: min(hits)]
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
    ) -> None:
        self._detok = detokenizer
        self._matcher = StopMatcher(stops)
        self.stop_ids = frozenset(stop_ids)
        self.finish_reason: FinishReason | None = None  # set once the text has ended

    def push(self, token_id: int) -> TextPiece:
        """One sampled token. ``finish`` is ``STOP`` when this token ended the text:
        a stop id (rule 1; the held-back tail is released with it) or a stop string
        (rule 3; what followed the stop string is dropped)."""
        self._check_open()
        if token_id in self.stop_ids:
            return self.finish(FinishReason.STOP)
        text, matched = self._matcher.feed(self._detok.push(token_id))
        if matched:
            self.finish_reason = FinishReason.STOP
            return TextPiece(text, FinishReason.STOP)
        return TextPiece(text)

    def finish(self, reason: FinishReason) -> TextPiece:
        """The sequence ended for ``reason`` (``length``, or ``stop`` on a stop id):
        release the held-back tail. The final reason is ``stop`` if that tail
        completed a stop string (rule 4), else ``reason``."""
        self._check_open()
        text, matched = self._matcher.finish(self._detok.flush())
        self.finish_reason = FinishReason.STOP if matched else reason
        return TextPiece(text, self.finish_reason)

    def _check_open(self) -> None:
        if self.finish_reason is not None:
            raise RuntimeError(f"the text has already ended ({self.finish_reason.value})")
