"""OpenAI's Responses API (``POST /v1/responses``), stateless, as a translation onto chat.

The Responses API is what newer OpenAI clients and the Agents SDK speak by default.
A request is a conversation like chat's, spelled as *items*:

- ``input``: a string (one user message), or a list of items: messages (``role`` and
  ``content``, a string or ``input_text`` / ``output_text`` parts), ``function_call``
  items (a call the model made earlier: ``call_id``, ``name``, ``arguments``) and
  ``function_call_output`` items (its result, by ``call_id``);
- ``instructions``: a system message before the input;
- ``tools``: function tools, flat (``{"type": "function", "name", "parameters"}``,
  where chat nests them under ``function``); ``tool_choice``, ``parallel_tool_calls``;
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
  ``strict``), chat's ``response_format`` under another name.

:func:`parse_responses` turns all of it into the chat request /v1/chat/completions
builds (consecutive calls become one assistant turn with ``tool_calls``, a result a
``tool`` message), so the chat template, the grammar and the tool-call parser are the
ones chat uses. :class:`ResponsesWriter` reads the answer back as the Response object:
``output`` holds a ``message`` item (its ``output_text``) and one ``function_call``
item per call; ``status`` is ``completed``, or ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when the budget cut it.

Streamed, the events are typed (``event:`` lines, a ``sequence_number`` from 0):
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``; for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta``
..., ``response.function_call_arguments.done``; then ``response.output_item.done``;
and last ``response.completed`` (or ``response.incomplete``, or ``response.failed``
with the error when the request failed after the status line went out).

Stateless: nothing is stored, so ``previous_response_id`` and ``conversation`` are
refused by name (send the whole conversation as ``input``); ``store`` is accepted and
stores nothing. Every field's treatment is :data:`RESPONSES_FIELDS`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from triollm.output import RequestStream
from triollm.plan import FinishReason
from triollm.request import ChatMessage, GrammarKind, GrammarSpec, ServedModel
from triollm.server import answers, sse
from triollm.server.apifields import Body, Field, FieldTable, Reader, refuse, required
from triollm.server.apifields import Support as S
from triollm.server.openai import ApiError, bad_request
from triollm.toolcalls import ToolCall, ToolCallDelta, Tools

__all__ = ["RESPONSES_FIELDS", "ResponsesWriter", "parse_responses"]

_STATELESS = "this server keeps no responses; send the whole conversation as 'input'"

RESPONSES_FIELDS = FieldTable(
    "responses",
    [
        Field("model", S.HONOURED, "the served model (or left out); another id is a 404"),
        Field("input", S.HONOURED, "text, or items: messages, function_call, function_call_output"),
        Field("instructions", S.HONOURED, "a system message before the input"),
        Field("max_output_tokens", S.HONOURED, "the answer's budget (chat's max_tokens)"),
        Field("temperature", S.HONOURED, "as chat's"),
        Field("top_p", S.HONOURED, "as chat's"),
        Field(
            "tools",
            S.HONOURED,
            "function tools (strict: forced calls follow the schema); others refused",
        ),
        Field("tool_choice", S.HONOURED, "none, auto, required, or {type: function, name}"),
        Field("parallel_tool_calls", S.HONOURED, "false: one call at most"),
        Field("text", S.HONOURED, "format: text, json_object, json_schema; verbosity refused"),
        Field("stream", S.HONOURED, "typed server-sent events"),
        Field("stream_options", S.ACCEPTED, "include_obfuscation: nothing to pad locally"),
        Field("store", S.ACCEPTED, "nothing is stored (stateless)"),
        Field("metadata", S.ACCEPTED, "echoed in the response"),
        Field("user", S.ACCEPTED, "a label"),
        Field("safety_identifier", S.ACCEPTED, "a label"),
        Field("prompt_cache_key", S.ACCEPTED, "the prefix cache needs no key"),
        Field("prompt_cache_retention", S.ACCEPTED, "the prefix cache keeps what fits"),
        Field("service_tier", S.ACCEPTED, "one tier"),
        Field("prompt_cache_options", S.ACCEPTED, "the prefix cache needs no breakpoints"),
        Field("access_programs", S.REFUSED, "no access programs"),
        Field("background_options", S.REFUSED, "no background responses"),
        Field("image", S.REFUSED, "text models only"),
        Field("moderation", S.REFUSED, "no moderation"),
        Field(
            "truncation",
            S.REFUSED,
            "'auto' drops input to make it fit; here a request that cannot fit is a 400",
            ("disabled",),
        ),
        Field("previous_response_id", S.REFUSED, _STATELESS),
        Field("conversation", S.REFUSED, _STATELESS),
        Field("background", S.REFUSED, "no background responses", (False,)),
        Field("include", S.REFUSED, "no extra output (logprobs, reasoning) is returned", ([],)),
        Field("top_logprobs", S.REFUSED, "log-probabilities are not returned here", (0,)),
        Field("reasoning", S.REFUSED, "no reasoning effort or summary"),
        Field("max_tool_calls", S.REFUSED, "no bound on calls across turns"),
        Field("prompt", S.REFUSED, "stored prompt templates live on OpenAI's servers"),
        Field("context_management", S.REFUSED, "no compaction"),
    ],
)

_TEXT_PARTS = ("input_text", "output_text", "text")


def _parts_text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts joined by newlines (as chat joins
    its text parts); an image, file or audio part is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise refuse(f"{where}.type", f"only text parts are read, got {kind!r}")
        value = part.get("text")
        if not isinstance(value, str):
            raise bad_request(f"'{where}.text' must be a string", f"{where}.text")
        texts.append(value)
    return "\n".join(texts)


def _conversation(instructions: str | None, items: Any) -> tuple[ChatMessage, ...]:
    """``instructions`` and ``input`` as chat turns, in OpenAI's message shape first."""
    turns: list[tuple[str, dict[str, Any]]] = []  # (param, OpenAI chat message)
    if instructions:
        turns.append(("instructions", {"role": "system", "content": instructions}))
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a non-empty string or a list of items", "input")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{param}' must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"'{param}.role' must be user, assistant, system or developer; got {role!r}",
                    f"{param}.role",
                )
            content = _parts_text(item.get("content"), f"{param}.content")
            turns.append((param, {"role": role, "content": content}))
        elif kind == "function_call":
            call = _call_item(item, param)
            last = turns[-1][1] if turns else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn, several calls
            else:
                turns.append((param, {"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"'{param}.call_id' must be a non-empty string", param)
            output = _parts_text(item.get("output"), f"{param}.output")
            turns.append((param, {"role": "tool", "content": output, "tool_call_id": call_id}))
        elif kind == "item_reference":
            raise refuse(f"{param}.type", _STATELESS)
        else:
            raise refuse(f"{param}.type", f"only message and function-call items, got {kind!r}")
    return tuple(answers.chat_message(m["role"], m["content"], p, m) for p, m in turns)


def _call_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str):
            raise bad_request(f"'{param}.{field}' must be a string", f"{param}.{field}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(body: dict[str, Any]) -> Tools | None:
    raw = Reader(body).items("tools") or []
    definitions = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise refuse(f"tools[{i}].type", f"only function tools, got {kind!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        definitions.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise refuse("tool_choice", f"only a function choice, got {choice.get('type')!r}")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if not definitions:
        choice = None if choice in (None, "none", "auto") else choice
    parallel = Reader(body).boolean("parallel_tool_calls", True)
    return answers.function_tools(definitions, choice, parallel)


def _text_format(body: dict[str, Any]) -> GrammarSpec | None:
    config = Reader(body).obj("text")
    if config is None:
        return None
    verbosity = config.get("verbosity")
    if verbosity not in (None, "medium"):
        raise refuse("text.verbosity", "the answer's length is the model's own")
    fmt = Reader(config, "text.").obj("format")
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, None, "text.format")
    if fmt["type"] != "json_schema":
        raise bad_request(
            f"'text.format.type' must be text, json_object or json_schema; got {fmt['type']!r}",
            "text.format.type",
        )
    schema = required(fmt.get("schema"), "text.format.schema", "a JSON Schema object")
    if not isinstance(schema, dict):
        raise bad_request("'text.format.schema' must be a JSON Schema object", "text.format.schema")
    return GrammarSpec(GrammarKind.JSON_SCHEMA, schema, "text.format.schema")


def parse_responses(raw: bytes) -> answers.Translation:
    """``POST /v1/responses``: the body as a chat request (a 400 naming the field)."""
    r = Body(raw, RESPONSES_FIELDS)
    body = r.body
    instructions = r.string("instructions")
    req = answers.chat_request(
        (_conversation(instructions, body.get("input")), False),  # nothing to continue
        _tools(body),
        _text_format(body),
        "tool_choice",
        model=r.string("model") or None,
        max_tokens=r.integer("max_output_tokens", 1),
        temperature=r.number("temperature", 1.0),
        top_p=r.number("top_p", 1.0),
        stream=r.boolean("stream"),
        user=r.string("user"),
    )
    # What the Response object repeats of the request (OpenAI's shape echoes them).
    echo = {
        "instructions": instructions,
        "max_output_tokens": req.max_tokens,
        "metadata": r.obj("metadata") or {},
        "parallel_tool_calls": r.boolean("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": req.temperature,
        "text": {"format": (r.obj("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "user": req.user,
    }

    def writer(model: ServedModel, stream: RequestStream) -> ResponsesWriter:
        return ResponsesWriter(model, stream, echo)

    return answers.Translation("responses", req, writer, r.unknown)


# --------------------------------------------------------------------------- the answer


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status != "in_progress" else [],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item_out(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesWriter:
    """Turns a one-choice RequestStream into the Response object, whole or as events.

    Built before the response starts (the quart request is gone inside the body
    generator); ``echo`` is what the Response repeats of the request.
    """

    media_type = sse.CONTENT_TYPE

    def __init__(self, model: ServedModel, stream: RequestStream, echo: dict[str, Any]) -> None:
        self.model = model
        self.stream = stream
        self.echo = echo
        self.id = _new_id("resp_")
        self.created = int(time.time())
        # the stream's state: the finished items, and the one being written
        self._done: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # {"kind", "id", "text" | "call"}
        self._seq = itertools.count()

    def _response(
        self, status: str, output: list[dict[str, Any]], finish: answers.Finish | None = None
    ) -> dict[str, Any]:
        usage = None
        if finish is not None:
            usage = {
                "input_tokens": finish.prompt_tokens,
                "input_tokens_details": {"cached_tokens": finish.cached_tokens},
                "output_tokens": finish.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            }
        cut = finish is not None and finish.reason is FinishReason.LENGTH
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": self.model.id,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    @staticmethod
    def _status(finish: answers.Finish) -> str:
        return "incomplete" if finish.reason is FinishReason.LENGTH else "completed"

    # -- whole ------------------------------------------------------------------------

    async def whole(self) -> tuple[dict[str, Any], int]:
        try:
            answer = await answers.collect(self.stream)
        except answers.StreamFailed as exc:
            err = ApiError(exc.status, exc.message, type="server_error", code=exc.code)
            return err.body(), exc.status
        return self._response(self._status(answer.finish), self._output(answer), answer.finish), 200

    def _output(self, answer: answers.Answer) -> list[dict[str, Any]]:
        status = self._status(answer.finish)
        items = []
        if answer.text or not answer.calls:
            items.append(_message_item(_new_id("msg_"), answer.text, status))
        items += [_call_item_out(_new_id("fc_"), c, status) for c in answer.calls]
        return items

    # -- events -----------------------------------------------------------------------

    def _event(self, kind: str, **payload: Any) -> bytes:
        return sse.named_event(kind, {"type": kind, "sequence_number": next(self._seq), **payload})

    async def events(self) -> AsyncIterator[bytes]:
        """The typed event stream (see the module docstring). No cleanup here: the
        middleware ends the request."""
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        try:
            async for item in answers.pieces(self.stream):
                piece = item if isinstance(item, answers.Piece) else item.last
                for event in self._piece(piece):
                    yield event
                if isinstance(item, answers.Finish):
                    status = self._status(item)
                    if not self._done and self._open is None:  # an empty answer: as whole()
                        for event in self._open_message():
                            yield event
                    for event in self._close(status):
                        yield event
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield self._event(kind, response=self._response(status, self._done, item))
        except answers.StreamFailed as exc:
            failed = self._response("failed", self._done)
            failed["error"] = {"code": exc.code, "message": exc.message}
            yield self._event("response.failed", response=failed)

    def _piece(self, piece: answers.Piece) -> Iterator[bytes]:
        if piece.text:
            yield from self._text(piece.text)
        for call in piece.calls:
            yield from self._call(call)

    def _index(self) -> int:
        return len(self._done)  # the open item's output_index

    def _open_message(self) -> Iterator[bytes]:
        yield from self._close("completed")
        self._open = {"kind": "message", "id": _new_id("msg_"), "text": ""}
        item = _message_item(self._open["id"], "", "in_progress")
        yield self._event("response.output_item.added", output_index=self._index(), item=item)
        yield self._event(
            "response.content_part.added",
            item_id=self._open["id"],
            output_index=self._index(),
            content_index=0,
            part=_text_part(""),
        )

    def _text(self, delta: str) -> Iterator[bytes]:
        if self._open is None or self._open["kind"] != "message":
            yield from self._open_message()
        assert self._open is not None
        self._open["text"] += delta
        yield self._event(
            "response.output_text.delta",
            item_id=self._open["id"],
            output_index=self._index(),
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def _call(self, t: ToolCallDelta) -> Iterator[bytes]:
        if t.id is not None:  # the first piece of a call: a new output item
            yield from self._close("completed")
            call = ToolCall(t.id, t.name or "", "")
            self._open = {"kind": "call", "id": _new_id("fc_"), "call": call}
            item = _call_item_out(self._open["id"], call, "in_progress")
            yield self._event("response.output_item.added", output_index=self._index(), item=item)
        if self._open is None or self._open["kind"] != "call" or not t.arguments:
            return
        old = self._open["call"]
        self._open["call"] = ToolCall(old.id, old.name, old.arguments + t.arguments)
        yield self._event(
            "response.function_call_arguments.delta",
            item_id=self._open["id"],
            output_index=self._index(),
            delta=t.arguments,
        )

    def _close(self, status: str) -> Iterator[bytes]:
        """End the open item (if any) with its ``done`` events."""
        item = self._open
        if item is None:
            return
        self._open = None
        index, item_id = self._index(), item["id"]
        if item["kind"] == "message":
            text = item["text"]
            yield self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=_text_part(text),
            )
            done = _message_item(item_id, text, status)
        else:
            call: ToolCall = item["call"]
            arguments = call.arguments or "{}"
            call = ToolCall(call.id, call.name, arguments)
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=call.name,
                arguments=arguments,
            )
            done = _call_item_out(item_id, call, status)
        self._done.append(done)
        yield self._event("response.output_item.done", output_index=index, item=done)
