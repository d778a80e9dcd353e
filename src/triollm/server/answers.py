"""What the translated APIs share: the request they build, and the answer they read back.

The Responses API (``openai_responses.py``), Anthropic's Messages API (``anthropic.py``)
and Ollama's (``ollama.py``) are translations: each parses its body into the one
:class:`~triollm.request.GenerationRequest` that /v1/chat/completions builds too
(``request.Preparer`` turns it into the spec; nothing below the edge learns which API
asked), and reads the answer back from the same :class:`~triollm.output.RequestStream`.

- :class:`Translation`: a parsed body: the request, the writer that shapes the answer
  in the API's own JSON or stream, and the fields nobody knows (logged once).
- :func:`chat_message`: one conversation turn as the chat template gets it, tool calls
  and results shaped by ``structured.message_tool_fields`` (one owner of that shape).
- :func:`pieces` / :func:`collect`: a one-choice stream as text-and-call pieces ending in
  a :class:`Finish`, or as the whole :class:`Answer`. A choice that fails raises
  :class:`StreamFailed` with the status a whole-body answer gets.

Trap: the last piece of text arrives with the :class:`Finish`, not before it. A writer
that strips a matched stop string off the end (Anthropic's ``stop_sequence``) can only
do so because nothing of that string has been sent yet (``textstream.StopMatcher``
holds back any text that could still become a stop string).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from triollm.errors import FieldError
from triollm.events import Completed, Delta, Failed, Outcome
from triollm.outcomes import EndCode
from triollm.output import RequestStream
from triollm.plan import FinishReason
from triollm.request import ChatMessage, GenerationRequest, GrammarSpec, ServedModel
from triollm.server import structured
from triollm.server.apifields import text
from triollm.server.openai import bad_request, field_error
from triollm.server.responses import STATUS_OF_END
from triollm.spec import GenerationSpec
from triollm.toolcalls import ParsedDelta, ToolCall, ToolCallDelta, Tools, merge

__all__ = [
    "Answer",
    "Finish",
    "Piece",
    "StreamFailed",
    "Translation",
    "Writer",
    "arguments_object",
    "chat_message",
    "chat_request",
    "collect",
    "function_tools",
    "one_constraint",
    "pieces",
]


class Writer(Protocol):
    """Shapes one admitted request's answer in an API's own format."""

    media_type: str  # of the streamed body (text/event-stream, application/x-ndjson)

    def events(self) -> AsyncIterator[bytes]: ...

    async def whole(self) -> tuple[dict[str, Any], int]: ...


@dataclass(frozen=True)
class Translation:
    """A body parsed by one API: the request, how to shape its answer, and which fields
    nobody knows. ``adjust``: a last change to the prepared spec that only this API
    asks for (Ollama's ``num_ctx``), raising an ApiError for a request it refuses."""

    api: str
    request: GenerationRequest
    writer: Callable[[ServedModel, RequestStream], Writer]
    unknown: tuple[str, ...] = ()
    adjust: Callable[[GenerationSpec], GenerationSpec] | None = None


def chat_message(
    role: str, content: str, param: str, tool_fields: Mapping[str, Any] | None = None
) -> ChatMessage:
    """One turn for the chat template. ``tool_fields`` are OpenAI's message fields
    (``tool_calls``, ``tool_call_id``, ``name``): every API translates its own spelling
    into them, and ``structured.message_tool_fields`` shapes them for the template."""
    extra: dict[str, Any] = {}
    if tool_fields:
        try:
            extra = structured.message_tool_fields(param, role, tool_fields)
        except FieldError as exc:
            raise field_error(exc) from None
    return ChatMessage(role=role, content=text(content, param), tools=tuple(extra.items()))


def arguments_object(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object the APIs that send objects want (Anthropic's
    ``input``, Ollama's ``arguments``); None when the text is not a JSON object (a
    call in ``auto`` mode is the model's own writing, and may be broken)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# --------------------------------------------------------------------------- reading answers


@dataclass(frozen=True, slots=True)
class Piece:
    """Text and pieces of calls, in the order the model wrote them."""

    text: str
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a completed answer: its last piece, why it ended, and the counts."""

    last: Piece
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class StreamFailed(Exception):
    """The choice did not complete. ``code`` is the end code's value; ``status`` the
    HTTP status a whole-body answer gets (a shutdown is 503: worth a retry)."""

    def __init__(self, outcome: Outcome | None) -> None:
        if isinstance(outcome, Failed):
            code, message = outcome.code, outcome.message
        else:
            code, message = EndCode.INTERNAL, "the stream ended without an outcome"
        super().__init__(message)
        self.code = code.value
        self.message = message
        self.status = STATUS_OF_END.get(code, 500)


async def pieces(stream: RequestStream) -> AsyncIterator[Piece | Finish]:
    """A one-choice stream as :class:`Piece` values, then one :class:`Finish`; raises
    :class:`StreamFailed` if it ends any other way."""
    async for event in stream.events():
        if isinstance(event, Delta):
            if event.text or event.tool_calls:
                yield Piece(event.text, event.tool_calls)
            continue
        outcome = event.outcome
        if not isinstance(outcome, Completed):
            raise StreamFailed(outcome)
        final = outcome.final
        yield Finish(
            Piece(final.text, final.tool_calls),
            outcome.finish_reason,
            outcome.prompt_tokens,
            outcome.completion_tokens,
            outcome.cached_tokens,
        )
        return
    raise StreamFailed(stream.outcome)  # the channel closed under the running choice


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: its text, its whole calls, and how it ended."""

    text: str
    calls: tuple[ToolCall, ...]
    finish: Finish


async def collect(stream: RequestStream) -> Answer:
    """The whole answer of a one-choice stream (raises :class:`StreamFailed`)."""
    parts: list[ParsedDelta] = []
    async for item in pieces(stream):
        if isinstance(item, Piece):
            parts.append(ParsedDelta(item.text, item.calls))
            continue
        parts.append(ParsedDelta(item.last.text, item.last.calls))
        content, calls = merge(parts)
        return Answer(content, calls, item)
    raise AssertionError("pieces() ends with a Finish or raises")  # pragma: no cover


def function_tools(
    definitions: list[dict[str, Any]], choice: Any, parallel: bool | None
) -> Tools | None:
    """Tools in OpenAI's chat shape (``{"type": "function", "function": {...}}``, the
    choice as ``tool_choice``), read by ``structured.tools``: every API translates its
    own spelling into this one, so one reader owns what a tool may be."""
    body = {"tools": definitions, "tool_choice": choice, "parallel_tool_calls": parallel}
    try:
        return structured.tools(body)
    except FieldError as exc:
        raise field_error(exc) from None


def chat_request(
    turns: tuple[tuple[ChatMessage, ...], bool],
    tools: Tools | None,
    grammar: GrammarSpec | None,
    forced_by: str,
    **fields: Any,
) -> GenerationRequest:
    """The chat request a translated API builds: its conversation and whether its final
    assistant turn is to be continued (prefill: the template leaves that turn open), its
    tools and output grammar (a forced call cannot also follow a grammar: the 400 names
    ``forced_by``), and the rest of its :class:`~triollm.request.GenerationRequest`
    fields as the API spells them out."""
    one_constraint(tools, grammar, forced_by)
    messages, prefill = turns
    return GenerationRequest(
        kind="chat",
        messages=messages,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        tools=tools,
        grammar=grammar,
        **fields,
    )


def one_constraint(tools: Tools | None, grammar: GrammarSpec | None, param: str) -> None:
    """A forced call is a grammar of its own: it cannot also follow ``grammar``."""
    if tools is not None and tools.forced() and grammar is not None:
        raise bad_request(
            f"'{param}' forces a tool call, which cannot also follow '{grammar.field}'; give one",
            param,
        )
