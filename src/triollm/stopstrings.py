"""Stop strings on streamed text: one matcher for the server and for ``triollm generate``.

Text arrives in pieces (one per token, from the incremental detokenizer). A stop
string can straddle two pieces, so matching each piece alone misses it, and
matching only the final text would already have sent its first half. The matcher
holds back the longest suffix of the pending text that is a prefix of some stop
string, releases everything before it, and on a match returns the text up to the
earliest stop string (OpenAI's rule: the stop sequence itself is not returned).

Trap (the end of a sequence): the detokenizer's ``flush()`` may release text it
held back (half a UTF-8 character, a pending word piece). That tail must go
through :meth:`StopMatcher.feed` like any other piece, and a match there makes the
finish reason ``stop``: see :meth:`StopMatcher.finish`. Pure Python; no trio, so
the offline CLI imports it without the server's dependencies.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Holds back text that could still turn into a stop string; never emits one."""

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
