"""How a request ends when it does not finish: named codes, never bare strings.

Two enums, because a request can end early in two places:

- :class:`EndCode`: an admitted request whose stream was cut (``Failed.code`` in
  ``events.py``); the service sets it, the HTTP edge logs it and maps it to a status.
- :class:`Refused`: a request turned away before it was admitted (a full queue, a
  wait past the budget, a bad body); the admission queue and the HTTP edge raise it.

The metrics (``server/metrics.py``) label ``triollm:request_rejections`` with both,
pre-creating one series per member, so a code that is not a member cannot be
spelled: adding a member is the one place a new code is written. Pure standard
library, like ``plan.py``.
"""

from __future__ import annotations

import enum


class EndCode(enum.Enum):
    """Why an admitted request's stream ended without finishing."""

    CLIENT_CLOSED = "client_closed"  # the client left (HTTP 499 in the log)
    TOO_SLOW = "too_slow"  # the client fell stream_buffer_steps behind; it was cut
    SHUTDOWN = "shutdown"  # the grace period of a shutdown ran out
    INTERNAL = "internal"  # the server's fault: a failed step, or the batch loop itself
    GRAMMAR_FAILED = "grammar_failed"  # its grammar's matcher failed mid-answer (a parser limit)


class Refused(enum.Enum):
    """Why a request was turned away before it was admitted."""

    QUEUE_FULL = "queue_full"  # 429 at once: max_waiters already wait
    QUEUE_TIMEOUT = "queue_timeout"  # 429 after queue_wait_s without a slot
    BAD_REQUEST = "bad_request"  # 400/404/413: the client's request was wrong


Unfinished = EndCode | Refused  # every way a request ends without finishing
