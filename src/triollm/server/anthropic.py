"""Anthropic's Messages API (``POST /v1/messages``), as a translation onto chat.

What Claude clients (the ``anthropic`` SDK, Claude Code pointed at a local server,
LangChain's ``ChatAnthropic``) send, and what llama-server and vLLM serve too:

- ``system``: a string or text blocks, the system message;
- ``messages``: ``user`` and ``assistant`` turns whose ``content`` is a string or a
  list of blocks: ``text``; on an assistant turn ``tool_use`` (``id``, ``name``,
  ``input``: a call the model made); on a user turn ``tool_result`` (``tool_use_id``,
  ``content``, ``is_error``: what the call returned). Each ``tool_result`` becomes a
  ``tool`` message (chat's spelling) before the turn's text; ``tool_use`` blocks become
  the assistant turn's ``tool_calls``. Images, documents and thinking blocks are refused
  by name (``messages[2].content[0].type``);
- ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice``
  (``auto``, ``any`` = chat's ``required``, ``tool`` + ``name`` = a named function,
  ``none``; ``disable_parallel_tool_use``);
- ``max_tokens`` (required, as Anthropic requires it), ``stop_sequences``,
  ``temperature`` (Anthropic's range, 0 to 1), ``top_p``, ``top_k``, ``stream``;
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``, or the beta
  ``output_format``): the answer is constrained to the schema, as chat's
  ``response_format``.

The answer is a ``message``: ``content`` holds a ``text`` block and one ``tool_use``
block per call (``input`` is the arguments object), ``stop_reason`` is ``end_turn``,
``max_tokens``, ``tool_use`` or ``stop_sequence`` (with the matched string in
``stop_sequence``). To know *which* stop string ended it, the request keeps matched
stop strings in the text (``include_stop_str_in_output``) and the writer takes it off
the end again: the last piece of text arrives with the end (``answers.Finish``), before
anything of the stop string has been sent.

Streamed (``event:`` lines): ``message_start``, then per block ``content_block_start``,
``content_block_delta`` (``text_delta``, or ``input_json_delta`` pieces of a call's
arguments), ``content_block_stop``; then ``message_delta`` (``stop_reason``, the output
token count) and ``message_stop``. A failure after the status line went out is an
``error`` event. Errors are Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``; the 400's message names the field.

A conversation that ends with an assistant turn asks to *continue* that turn
(prefill): the request continues the final message (``continue_final_message``, the
template leaves the turn open), and the answer holds only the continuation, as
Anthropic answers. An assistant turn that ends in ``tool_use`` is not open: it needs
its ``tool_result`` first (a 400 naming it).

Auth: the door checks ``Authorization: Bearer``; the ``anthropic`` client sends that
when given ``auth_token=`` (its ``api_key=`` goes into ``x-api-key``, which a server
started with ``--api-key`` does not read).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from triollm.output import RequestStream
from triollm.plan import FinishReason
from triollm.request import ChatMessage, GenerationRequest, GrammarKind, GrammarSpec, ServedModel
from triollm.server import answers, sse
from triollm.server.apifields import Body, Field, FieldTable, Reader, refuse, required
from triollm.server.apifields import Support as S
from triollm.server.openai import ApiError, bad_request, load_object
from triollm.toolcalls import ToolCall, ToolCallDelta, Tools

__all__ = [
    "MESSAGES_FIELDS",
    "MessagesWriter",
    "error_body",
    "parse_count_tokens",
    "parse_messages",
]

MESSAGES_FIELDS = FieldTable(
    "messages",
    [
        Field("model", S.HONOURED, "the served model; another id is a 404"),
        Field("max_tokens", S.HONOURED, "required: the answer's budget"),
        Field(
            "messages",
            S.HONOURED,
            "turns of text, tool_use, tool_result; a final assistant turn is continued",
        ),
        Field("system", S.HONOURED, "a string or text blocks: the system message"),
        Field("stop_sequences", S.HONOURED, "stop strings; the matched one is in stop_sequence"),
        Field("temperature", S.HONOURED, "0 to 1"),
        Field("top_p", S.HONOURED, "as chat's"),
        Field("top_k", S.HONOURED, "as chat's"),
        Field("stream", S.HONOURED, "typed server-sent events"),
        Field("tools", S.HONOURED, "custom tools (input_schema); server tools are refused"),
        Field("tool_choice", S.HONOURED, "auto, any, tool (+ name), none"),
        Field("metadata", S.ACCEPTED, "user_id: a label"),
        Field("service_tier", S.ACCEPTED, "one tier"),
        Field("thinking", S.REFUSED, "no separate thinking blocks", ({"type": "disabled"},)),
        Field("container", S.REFUSED, "no code-execution container"),
        Field("mcp_servers", S.REFUSED, "the server calls no MCP servers"),
        Field("context_management", S.REFUSED, "no context editing"),
        Field(
            "output_config",
            S.HONOURED,
            "format: a json_schema constrains the answer; effort refused",
        ),
        Field("output_format", S.HONOURED, "the beta spelling of output_config.format"),
        Field("cache_control", S.ACCEPTED, "the prefix cache needs no marker"),
        Field("inference_geo", S.ACCEPTED, "it runs here"),
        Field("speed", S.ACCEPTED, "one speed"),
        Field("user_profile_id", S.ACCEPTED, "a label"),
        Field("workspace_id", S.ACCEPTED, "a label"),
        Field("diagnostics", S.REFUSED, "no cache diagnostics"),
    ],
)

# Anthropic's error types by status (their API reference, "Errors").
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: ApiError) -> dict[str, Any]:
    """An ApiError in Anthropic's shape; the message already names the field."""
    kind = _ERROR_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# --------------------------------------------------------------------------- the request


def _blocks_text(content: Any, param: str) -> str:
    """A tool_result's or system's content: a string, or text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or a list of text blocks", param)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise refuse(f"{param}[{j}].type", f"only text blocks are read, got {kind!r}")
        texts.append(block["text"])
    return "\n".join(texts)


def _turn(i: int, message: Any) -> list[tuple[str, dict[str, Any]]]:
    """One Anthropic message as chat turns (OpenAI's message shape, with their param)."""
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"'{param}' must be an object", param)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(
            f"'{param}.role' must be user or assistant; got {role!r}", f"{param}.role"
        )
    content = message.get("content")
    if isinstance(content, str):
        return [(param, {"role": role, "content": content})]
    if not isinstance(content, list):
        raise bad_request(f"'{param}.content' must be a string or a list of blocks", param)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[tuple[str, dict[str, Any]]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            name, call_id, given = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad_request(f"'{where}' must have a string 'id' and 'name'", where)
            if not isinstance(given, dict):
                raise bad_request(f"'{where}.input' must be an object", f"{where}.input")
            function = {"name": name, "arguments": json.dumps(given, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"'{where}.tool_use_id' must be a non-empty string", where)
            output = _blocks_text(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                output = f"Error: {output}"  # chat's tool role has no error flag
            results.append((where, {"role": "tool", "content": output, "tool_call_id": call_id}))
        else:
            raise refuse(
                f"{where}.type", f"a {role} turn reads text, tool_use / tool_result; got {kind!r}"
            )
    turns = list(results)  # the results answer the previous turn's calls: first
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append((param, turn))
    return turns


def _conversation(body: dict[str, Any]) -> tuple[tuple[ChatMessage, ...], bool]:
    """The turns, and whether the last is an assistant turn to continue (prefill)."""
    turns: list[tuple[str, dict[str, Any]]] = []
    system = body.get("system")
    if system is not None:
        turns.append(("system", {"role": "system", "content": _blocks_text(system, "system")}))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of turns", "messages")
    for i, message in enumerate(messages):
        turns += _turn(i, message)
    last = turns[-1][1]
    # Prefill: the answer continues the final assistant turn's text (the template
    # leaves it open).
    if last["role"] == "assistant" and last.get("tool_calls"):
        raise bad_request(
            f"'messages[{len(messages) - 1}]' ends in tool_use: its tool_result goes in a "
            "user turn after it",
            f"messages[{len(messages) - 1}]",
        )
    prefill = last["role"] == "assistant"
    return tuple(answers.chat_message(m["role"], m["content"], p, m) for p, m in turns), prefill


def _tools(body: dict[str, Any]) -> Tools | None:
    raw = Reader(body).items("tools") or []
    definitions = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_request(f"'tools[{i}]' must be an object", f"tools[{i}]")
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise refuse(f"tools[{i}].type", f"only custom tools (input_schema), got {kind!r}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'tools[{i}].name' must be a non-empty string", f"tools[{i}].name")
        # In OpenAI's key order: a template that dumps the tool as JSON (Qwen's) renders
        # the same prompt as chat's for the same tool.
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema", {})
        definitions.append({"type": "function", "function": fn})
    choice_raw = Reader(body).obj("tool_choice") or {}
    kind = choice_raw.get("type", "auto")
    choice: Any
    if kind in ("auto", "none"):
        choice = kind
    elif kind == "any":
        choice = "required"
    elif kind == "tool":
        choice = {"type": "function", "function": {"name": choice_raw.get("name")}}
    else:
        raise bad_request(
            f"'tool_choice.type' must be auto, any, tool or none; got {kind!r}", "tool_choice"
        )
    if not definitions:
        if kind not in ("auto", "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    parallel = not choice_raw.get("disable_parallel_tool_use", False)
    return answers.function_tools(definitions, choice, parallel)


def _output_format(body: dict[str, Any]) -> GrammarSpec | None:
    """``output_config.format`` (or the beta ``output_format``): a JSON Schema the answer
    must follow, as chat's ``response_format`` json_schema."""
    config = Reader(body).obj("output_config") or {}
    for name in config:
        if name != "format" and config[name] is not None:
            raise refuse(f"output_config.{name}", "only output_config.format is read")
    found = [
        ("output_config.format", config.get("format")),
        ("output_format", body.get("output_format")),
    ]
    given = [(where, fmt) for where, fmt in found if fmt is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request("give output_config.format or output_format, not both", "output_format")
    where, fmt = given[0]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f'\'{where}\' must be {{"type": "json_schema", "schema": ...}}', where)
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON Schema object", f"{where}.schema")
    return GrammarSpec(GrammarKind.JSON_SCHEMA, schema, f"{where}.schema")


def parse_messages(raw: bytes) -> answers.Translation:
    """``POST /v1/messages``: the body as a chat request (a 400 naming the field)."""
    r = Body(raw, MESSAGES_FIELDS)
    body = r.body
    max_tokens = required(r.integer("max_tokens", 1), "max_tokens", "the answer's budget")
    stops = r.stops("stop_sequences")
    tools = _tools(body)
    grammar = _output_format(body)
    req = answers.chat_request(
        _conversation(body),
        tools,
        grammar,
        "tool_choice",
        model=r.string("model") or None,
        max_tokens=max_tokens,
        temperature=r.number("temperature", 1.0, 0.0, 1.0),
        top_p=r.number("top_p", 1.0),
        top_k=r.integer("top_k", 0) or 0,
        stop=stops,
        # kept in the text so the writer can tell which one matched (module docstring)
        include_stop_str_in_output=bool(stops),
        stream=r.boolean("stream"),
    )

    def writer(model: ServedModel, stream: RequestStream) -> MessagesWriter:
        return MessagesWriter(model, stream, stops)

    return answers.Translation("messages", req, writer, r.unknown)


def parse_count_tokens(raw: bytes) -> GenerationRequest:
    """``POST /v1/messages/count_tokens``: the same conversation and tools, no answer
    (``max_tokens`` is not part of this body)."""
    body = load_object(raw)
    body.setdefault("max_tokens", 1)
    return parse_messages(json.dumps(body).encode()).request


# --------------------------------------------------------------------------- the answer

_STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
}


def _tool_block(call: ToolCall) -> dict[str, Any]:
    given = answers.arguments_object(call.arguments)
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": given or {}}


class MessagesWriter:
    """Turns a one-choice RequestStream into Anthropic's message, whole or as events."""

    media_type = sse.CONTENT_TYPE

    def __init__(self, model: ServedModel, stream: RequestStream, stops: tuple[str, ...]) -> None:
        self.model = model
        self.stream = stream
        self.stops = stops
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self._index = -1  # the open content block's index
        self._open: str | None = None  # "text" or "tool_use"

    def _ending(self, finish: answers.Finish, text: str) -> tuple[str, str, str | None]:
        """(the text without a matched stop string, stop_reason, stop_sequence)."""
        if finish.reason is FinishReason.STOP:
            for stop in self.stops:
                if text.endswith(stop):
                    return text[: -len(stop)], "stop_sequence", stop
        return text, _STOP_REASONS.get(finish.reason, "end_turn"), None

    def _usage(self, finish: answers.Finish) -> dict[str, Any]:
        return {
            # Anthropic counts cache reads apart from input_tokens
            "input_tokens": finish.prompt_tokens - finish.cached_tokens,
            "cache_read_input_tokens": finish.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": finish.completion_tokens,
        }

    def _message(
        self, content: list[dict[str, Any]], reason: str | None, stop: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model.id,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
        }

    # -- whole ------------------------------------------------------------------------

    async def whole(self) -> tuple[dict[str, Any], int]:
        try:
            answer: answers.Answer = await answers.collect(self.stream)
        except answers.StreamFailed as exc:
            err = ApiError(exc.status, exc.message, type="server_error", code=exc.code)
            return error_body(err), exc.status
        text, reason, stop = self._ending(answer.finish, answer.text)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        content += [_tool_block(c) for c in answer.calls]
        body = self._message(content, reason, stop)
        body["usage"] = self._usage(answer.finish)
        return body, 200

    # -- events -----------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **payload: Any) -> bytes:
        return sse.named_event(kind, {"type": kind, **payload})

    async def events(self) -> AsyncIterator[bytes]:
        start = self._message([], None, None)
        start["usage"] = {"input_tokens": self.stream.prompt_tokens, "output_tokens": 0}
        yield self._event("message_start", message=start)
        yield self._event("ping")
        try:
            async for item in answers.pieces(self.stream):
                if isinstance(item, answers.Piece):
                    for event in self._piece(item.text, item.calls):
                        yield event
                    continue
                text, reason, stop = self._ending(item, item.last.text)
                for event in self._piece(text, item.last.calls):
                    yield event
                for event in self._close():
                    yield event
                # the whole usage: the cache reads are known only now
                yield self._event(
                    "message_delta",
                    delta={"stop_reason": reason, "stop_sequence": stop},
                    usage=self._usage(item),
                )
                yield self._event("message_stop")
        except answers.StreamFailed as exc:
            kind = "overloaded_error" if exc.status == 503 else "api_error"
            yield self._event("error", error={"type": kind, "message": exc.message})

    def _piece(self, text: str, calls: tuple[ToolCallDelta, ...]) -> Iterator[bytes]:
        if text:
            if self._open != "text":
                yield from self._close()
                yield from self._start({"type": "text", "text": ""}, "text")
            yield self._event(
                "content_block_delta",
                index=self._index,
                delta={"type": "text_delta", "text": text},
            )
        for t in calls:
            if t.id is not None:
                yield from self._close()
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": t.id,
                    "name": t.name,
                    "input": {},
                }
                yield from self._start(block, "tool_use")
            if t.arguments and self._open == "tool_use":
                yield self._event(
                    "content_block_delta",
                    index=self._index,
                    delta={"type": "input_json_delta", "partial_json": t.arguments},
                )

    def _start(self, block: dict[str, Any], kind: str) -> Iterator[bytes]:
        self._index += 1
        self._open = kind
        yield self._event("content_block_start", index=self._index, content_block=block)

    def _close(self) -> Iterator[bytes]:
        if self._open is not None:
            self._open = None
            yield self._event("content_block_stop", index=self._index)
