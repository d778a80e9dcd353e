"""The two error families that are not bugs.

:class:`UserError` is the caller's fault and names what to fix (a file, a field, a
limit). The CLI prints it as one line and exits 2; the HTTP edge maps its
subclasses to 4xx. Capacity refusals (429) live in ``admission.py``. Anything else
is a bug and surfaces as a traceback or a 500 with a log line.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix, with a message that names the file/field and the limit."""


class ModelLoadError(UserError):
    """A model directory that cannot be loaded: missing file, bad JSON, unsupported
    model_type, missing or mis-shaped tensor. The message names the file and the field."""
