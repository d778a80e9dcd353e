"""Server-Sent Events framing for OpenAI-style streams.

One event is ``data: <json>\\n\\n``. A stream is any number of chunk events, a
final chunk carrying ``finish_reason``, optionally one usage chunk with empty
``choices`` (when the client asked for ``stream_options.include_usage``), then
``data: [DONE]``. A failure after the status line has gone out cannot change the
status, so it is an error event (``{"error": {...}}``) followed by ``[DONE]``:
the ``openai`` client raises it as an ``APIError`` instead of reading a
truncated body as a short success.

Each event is encoded on its own and handed to the ASGI server as its own
``http.response.body`` message; hypercorn writes each message to the socket
as one HTTP/1.1 chunk immediately (see docs/streaming.md). Nothing here buffers.

Trap: JSON must not contain a raw newline, or the event would end early.
``json.dumps`` escapes newlines inside strings and, with ``separators`` and no
``indent``, never emits one between tokens; keep it that way.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream"
# no-cache: a proxy must not hold the stream; X-Accel-Buffering: nginx must not buffer it.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + text.encode() + b"\n\n"


def error_event(message: str, *, type: str, code: str | None, param: str | None = None) -> bytes:
    """An error event in OpenAI's error shape (the stream must still end with [DONE])."""
    return event({"error": {"message": message, "type": type, "param": param, "code": code}})


def parse_events(body: bytes) -> list[str]:
    """Split a complete SSE body into its ``data:`` payloads (for tests and tools).

    Trap: only ``data:`` lines are kept; comments and other fields are dropped.
    """
    out = []
    for block in body.decode().split("\n\n"):
        lines = [ln[len("data: ") :] for ln in block.split("\n") if ln.startswith("data: ")]
        if lines:
            out.append("\n".join(lines))
    return out


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    """One event with an ``event:`` line: the typed streams of the Responses and
    Messages APIs name each event (``response.output_text.delta``, ``message_start``)."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return b"event: " + name.encode() + b"\ndata: " + text.encode() + b"\n\n"
