"""The two error families that are not bugs.

:class:`UserError` is the caller's fault and names what to fix (a file, a field, a
limit). The CLI prints it as one line and exits 2; the HTTP edge maps its
subclasses to 4xx. :class:`FieldError` is the one that blames a single named field:
sampling parameters, the scheduler's ``Infeasible`` and the sizing of the pool all
raise it, and each edge turns ``.field`` into its own spelling (OpenAI's ``param``,
a CLI flag) without ever parsing the message. Capacity refusals (429) live in
``admission.py``. Anything else is a bug and surfaces as a traceback or a 500 with
a log line.

Pure standard library: the policy layer (``scheduler.py``) imports it.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix, with a message that names the file/field and the limit."""


class FieldError(UserError, ValueError):
    """One named field is out of range. ``field`` is the field's own name
    (``"top_p"``, ``"max_tokens"``, ``"context_tokens"``); ``str()`` is the message,
    which names the field and the limit.

    A ``ValueError`` too, because that is what a bad argument to a constructor is in
    Python (``SamplingParams(top_p=0)``); callers that only know that much still work.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ModelLoadError(UserError):
    """A model directory that cannot be loaded: missing file, bad JSON, unsupported
    model_type, missing or mis-shaped tensor. The message names the file and the field."""
