"""Tool calls: the model's own call syntax, parsed back into OpenAI's ``tool_calls`` as it streams.

A chat model that was trained to call functions writes its calls as text in a syntax
of its family, and its chat template renders the tools (``tools=``) and earlier calls
(assistant ``tool_calls``, ``role: tool`` results) in that same syntax. The server's
job on the way out is the reverse: find the calls in the generated text, hand the
rest through as ``content``, and give each call as OpenAI shapes it::

    {"index": 0, "id": "call_...", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}

streamed as deltas: the first delta of a call carries its ``id`` and ``name``, the
following ones pieces of ``arguments`` (a JSON text, sent as it is generated).

The formats (:class:`ToolCallFormat`, named as vLLM's ``--tool-call-parser`` names them):

- ``hermes``: Qwen2.5, Qwen3, Hermes 2/3 and most fine-tunes:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``llama3_json``: Llama 3.1/3.2/3.3 JSON tool calling: the answer *is*
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``),
  several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``json``: no syntax of the model's own: the answer *is* a JSON list of calls,
  ``[{"name": ..., "arguments": {...}}, ...]``. A forced call (``tool_choice``
  ``required`` or named) on a model whose template shows no tool syntax is
  constrained to it, as vLLM forces such calls; it is never read from a template.

:func:`detect_format` picks one from the chat template's text, as the server does
when no ``--tool-call-parser`` is given. :func:`tool_grammar` builds the Lark
grammar that forces a well-formed call in the model's own syntax (or the ``json``
list), one whose
arguments are valid for the tool's JSON Schema, for ``tool_choice`` ``required``
or a named function (``model/constrained.py`` compiles and applies it).

This module is pure: text in, frozen deltas out; no trio, no numpy, no tokenizer.
Tests: ``tests/test_toolcalls.py``.
"""

from __future__ import annotations

import enum
import json
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class ToolCallFormat(enum.Enum):
    """How a model family writes a tool call (values are vLLM's parser names)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    # No syntax of the model's own: a JSON list of calls (forced calls only, see above)
    JSON = "json"


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"

# The text each format's calls begin with: special tokens among them must reach the
# parser, so the detokenizer keeps them in the text (they are dropped otherwise).
MARKERS: Mapping[ToolCallFormat, tuple[str, ...]] = {
    ToolCallFormat.HERMES: (HERMES_OPEN, HERMES_CLOSE),
    ToolCallFormat.LLAMA3_JSON: (PYTHON_TAG,),
    ToolCallFormat.MISTRAL: (MISTRAL_TOOL_CALLS,),
    ToolCallFormat.JSON: (),
}

# The key holding the arguments object in each format.
ARGUMENTS_KEY: Mapping[ToolCallFormat, str] = {
    ToolCallFormat.HERMES: "arguments",
    ToolCallFormat.LLAMA3_JSON: "parameters",
    ToolCallFormat.MISTRAL: "arguments",
    ToolCallFormat.JSON: "arguments",
}

# Formats whose whole answer is the call(s), with the character that answer opens with.
_WHOLE_ANSWER: Mapping[ToolCallFormat, str] = {
    ToolCallFormat.LLAMA3_JSON: "{",
    ToolCallFormat.JSON: "[",
}
# Formats whose calls sit in a JSON list: [call, call].
_LISTS = (ToolCallFormat.MISTRAL, ToolCallFormat.JSON)


# --------------------------------------------------------------------------- a request's tools


class ToolChoice(enum.Enum):
    """OpenAI's ``tool_choice``: whether the model may, must or must not call a tool."""

    NONE = "none"  # never: the text is content, even if it looks like a call
    AUTO = "auto"  # the model decides; calls in its syntax are parsed out
    REQUIRED = "required"  # at least one call, forced by a grammar
    NAMED = "named"  # exactly this one function, forced by a grammar


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools, validated: the definitions as the client sent them (the chat
    template renders them), and what the model may do with them."""

    definitions: tuple[dict[str, Any], ...]  # [{"type": "function", "function": {...}}]
    choice: ToolChoice
    named: str | None = None  # the function of ToolChoice.NAMED
    parallel: bool = True  # OpenAI's default

    @property
    def functions(self) -> tuple[dict[str, Any], ...]:
        """The ``function`` objects (``name``, ``parameters`` ...), in order."""
        return tuple(d["function"] for d in self.definitions)

    def forced(self) -> tuple[dict[str, Any], ...]:
        """The functions a forcing grammar admits (empty: no grammar)."""
        if self.choice is ToolChoice.REQUIRED:
            return self.functions
        if self.choice is ToolChoice.NAMED:
            return tuple(f for f in self.functions if f["name"] == self.named)
        return ()


def detect_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template renders, or None if it renders no tools.

    Looks for each family's markers in the template source: the template is the one
    place a checkpoint says how it was taught to call tools.
    """
    if not chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return ToolCallFormat.HERMES
    if MISTRAL_TOOL_CALLS in chat_template:
        return ToolCallFormat.MISTRAL
    if PYTHON_TAG in chat_template or (
        "<|start_header_id|>" in chat_template and '"parameters"' in chat_template
    ):
        return ToolCallFormat.LLAMA3_JSON
    return None


def new_call_id(fmt: ToolCallFormat) -> str:
    """A fresh call id: ``call_`` + 24 hex digits, or 9 letters and digits for Mistral,
    whose chat templates refuse any other shape of ``tool_call_id``."""
    if fmt is ToolCallFormat.MISTRAL:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one call, as OpenAI streams it: the first piece of call ``index``
    has ``id`` and ``name``; later ones only ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    """What one piece of generated text turned into: plain content and call pieces."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A whole call (the non-streaming ``message.tool_calls`` entry)."""

    id: str
    name: str
    arguments: str  # a JSON text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def merge(deltas: Sequence[ParsedDelta]) -> tuple[str, tuple[ToolCall, ...]]:
    """The content and whole calls that a sequence of deltas adds up to."""
    content = "".join(d.content for d in deltas)
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        for t in d.tool_calls:
            if t.id is not None:
                ids[t.index] = t.id
            if t.name is not None:
                names[t.index] = t.name
            args.setdefault(t.index, []).append(t.arguments)
    calls = tuple(
        ToolCall(ids[i], names[i], "".join(args[i]) or "{}") for i in sorted(ids) if i in names
    )
    return content, calls


# --------------------------------------------------------------------------- one JSON object


@dataclass
class _Member:
    key: str
    start: int  # where the value's text starts
    end: int | None = None  # one past its last character, once it ended
    last: int = 0  # one past its last non-space character seen so far


class _ObjectScanner:
    """Follows one JSON object character by character, recording where each top-level
    member's value starts and ends, so a value can be sent while it is still growing.

    It only tracks nesting, strings and escapes (enough to find the boundaries);
    the text is parsed with ``json`` once the object is whole. Invariant: ``text``
    holds everything fed since the opening brace, which is ``text[0]``.
    """

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.members: list[_Member] = []
        self._key_start: int | None = None  # a depth-1 string that may be a key
        self._pending_key: str | None = None  # key read, waiting for its ':'
        self._value_next = False  # after ':' at depth 1: the value starts at the next char
        self.closed = False

    def feed(self, ch: str) -> None:
        i = len(self.text)
        self.text += ch
        current = self.members[-1] if self.members and self.members[-1].end is None else None
        if self._value_next and not ch.isspace():
            self._value_next = False
            current = _Member(self._pending_key or "", i)
            self.members.append(current)
            self._pending_key = None
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self._key_start is not None and current is None:
                    self._pending_key = json.loads(self.text[self._key_start : i + 1])
                    self._key_start = None
        elif ch == '"':
            self.in_string = True
            if self.depth == 1 and current is None:
                self._key_start = i
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                if current is not None:
                    current.end = i
                self.closed = True
                return
        elif ch == ":" and self.depth == 1 and current is None:
            self._value_next = True
        elif ch == "," and self.depth == 1 and current is not None:
            current.end = i
            current = None
        if current is not None and not ch.isspace() and current.end is None:
            current.last = i + 1

    def member(self, key: str) -> _Member | None:
        return next((m for m in self.members if m.key == key), None)

    def string_value(self, key: str) -> str | None:
        """A finished top-level string member's value, or None."""
        m = self.member(key)
        if m is None:
            return None
        try:  # a string's text parses only once its closing quote has arrived
            value = json.loads(self.text[m.start : m.last])
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- the parser


class _Region(enum.Enum):
    TEXT = "text"  # plain content; watching for the start of a call
    BEFORE_OBJECT = "before_object"  # inside a call region, waiting for '{'
    OBJECT = "object"  # inside a call's JSON object
    AFTER_OBJECT = "after_object"  # a call ended; a closing tag, a separator or the end


@dataclass
class _Call:
    index: int
    scanner: _ObjectScanner = field(default_factory=_ObjectScanner)
    id: str | None = None  # set once announced (its first delta sent)
    name: str | None = None
    sent_args: int = 0  # characters of the arguments value already sent
    signature: str | None = None  # name and arguments, canonical JSON, once whole


class ToolCallParser:
    """Splits a stream of generated text into content and tool-call deltas.

    Feed each text piece to :meth:`feed` and send what it returns; call
    :meth:`finish` once at the end. Text that may be the start of a call marker is
    held back until it is clearly not one (as a stop string's tail is).

    A call whose text turns out not to be a call (broken JSON, no ``name``) is given
    back as content, if nothing of it was sent yet; once its name was announced it
    stays a call (a client has seen it), with the arguments sent so far.

    A weak model under a forcing grammar repeats its call until ``max_tokens`` (issue
    26: SmolLM2 answered two identical calls and the content ``</tool_call``, which
    LangChain sent back into the next turn). So a call that repeats an earlier one of
    the same answer word for word is dropped (a second call of the same function is
    held until it is whole, to compare), and what the budget cut after a call (the
    closing tag, the next call's first characters) is neither content nor a call.

    Trap: the parser only sees text. A marker that is a special token (Mistral's
    ``[TOOL_CALLS]``, ``<|python_tag|>``) must be kept in the text by the
    detokenizer (:data:`MARKERS`), or the calls arrive as plain content.
    """

    def __init__(
        self, fmt: ToolCallFormat, *, new_id: Callable[[ToolCallFormat], str] = new_call_id
    ) -> None:
        self.fmt = fmt
        self._new_id = new_id
        self._args_key = ARGUMENTS_KEY[fmt]
        self._region = _Region.TEXT
        self._held = ""  # text not yet classified (a possible marker prefix)
        self._calls: list[_Call] = []
        self._at_start = True  # nothing but whitespace generated yet (llama3_json)
        self._in_array = False  # mistral: inside [TOOL_CALLS][ ... ]

    @property
    def called(self) -> bool:
        """Whether at least one call was announced (finish_reason becomes ``tool_calls``)."""
        return any(c.id is not None for c in self._calls)

    def feed(self, text: str) -> ParsedDelta:
        """Consume a piece of generated text; return what can be sent now."""
        self._held += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        """The end of the generation: flush held text, close a call cut short."""
        return self._run(final=True)

    # -- the state machine ------------------------------------------------------------

    def _run(self, *, final: bool) -> ParsedDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        progress = True
        while progress:
            progress = False
            if self._region is _Region.TEXT:
                progress = self._text(content, final)
            elif self._region is _Region.BEFORE_OBJECT:
                progress = self._before_object(content, final)
            elif self._region is _Region.OBJECT:
                progress = self._object(content, calls, final)
            else:
                progress = self._after_object(content, final)
        if final and self._region is _Region.OBJECT:
            self._close_call(self._calls[-1], content, calls, cut=True)
            self._region = _Region.TEXT
        if final and self._region is not _Region.TEXT:
            self._region = _Region.TEXT
            self._emit(content, self._held)
            self._held = ""
        if final and self._held:
            self._emit(content, self._held)
            self._held = ""
        return ParsedDelta("".join(content), tuple(calls))

    def _text(self, content: list[str], final: bool) -> bool:
        held = self._held
        opener = _WHOLE_ANSWER.get(self.fmt)
        if opener is not None and self._at_start:
            lead = held.lstrip()
            if lead.startswith(opener):  # the whole answer is the call(s)
                self._held, self._at_start = lead, False
                self._region = _Region.BEFORE_OBJECT
                return True
            tag = PYTHON_TAG if self.fmt is ToolCallFormat.LLAMA3_JSON else None
            if tag is not None and lead.startswith(tag):
                self._held, self._at_start = lead[len(tag) :], False
                self._region = _Region.BEFORE_OBJECT
                return True
            if not final and (not lead or (tag is not None and tag.startswith(lead))):
                return False  # it may still turn into a call
            self._at_start = False
        marker = {ToolCallFormat.HERMES: HERMES_OPEN, ToolCallFormat.MISTRAL: MISTRAL_TOOL_CALLS}
        start = marker.get(self.fmt)
        at = held.find(start) if start else -1
        if start and at >= 0:
            self._emit(content, held[:at])
            self._held = held[at + len(start) :]
            self._region = _Region.BEFORE_OBJECT
            return True
        # Hold back a tail that could still become the marker.
        keep = 0 if final or not start else _partial_suffix(held, start)
        out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        if self._calls and not out.strip() and not final:
            self._held = out + self._held  # whitespace after a call: content only if more follows
            return False
        if final and self._calls and start:
            tail = _partial_suffix(out, start)
            if tail and not out[: len(out) - tail].strip():
                out = ""  # the next call's marker, cut short by the budget: not content
        self._emit(content, out)
        return False

    def _emit(self, content: list[str], text: str) -> None:
        if self._calls and not text.strip():
            return  # the whitespace between and after calls is not content
        if text:
            content.append(text)

    def _before_object(self, content: list[str], final: bool) -> bool:
        stripped = self._held.lstrip()
        if not stripped:
            self._held = ""
            return False
        if self.fmt in _LISTS and stripped[0] == "[" and not self._in_array:
            self._in_array = True
            self._held = stripped[1:]
            return True
        if stripped[0] == "{":
            self._held = stripped
            self._region = _Region.OBJECT
            self._calls.append(_Call(len(self._calls)))
            return True
        # Not a call after all: what follows the marker is content (and a JSON
        # answer's own opening bracket, which the json format took for its list's).
        if self.fmt is ToolCallFormat.JSON and self._in_array and not self._calls:
            stripped, self._in_array = "[" + stripped, False
        self._held = stripped
        self._region = _Region.TEXT
        return True

    def _object(self, content: list[str], calls: list[ToolCallDelta], final: bool) -> bool:
        call = self._calls[-1]
        scanner = call.scanner
        consumed = 0
        for ch in self._held:
            scanner.feed(ch)
            consumed += 1
            if scanner.closed:
                break
        self._held = self._held[consumed:]
        if scanner.closed:  # whole: _close_call announces it, unless it is a repeat
            is_call = self._close_call(call, content, calls, cut=False)
            self._region = _Region.AFTER_OBJECT if is_call else _Region.TEXT
            return True
        self._announce(call, calls)
        return False

    def _announce(self, call: _Call, calls: list[ToolCallDelta]) -> None:
        """Send the call's id and name once the name is known, then its arguments."""
        if call.id is None:
            name = call.scanner.string_value("name")
            if name is None:
                return
            if not call.scanner.closed and any(c.name == name for c in self._calls[:-1]):
                return  # perhaps a repeat of an earlier call: decided once whole (_close_call)
            call.id, call.name = self._new_id(self.fmt), name
            calls.append(ToolCallDelta(call.index, call.id, name, ""))
        args = call.scanner.member(self._args_key) or call.scanner.member("arguments")
        if args is None or call.scanner.text[args.start : args.start + 1] == '"':
            return  # not started, or a JSON-encoded string: sent whole when it ends
        piece = call.scanner.text[args.start + call.sent_args : args.last]
        if piece:
            call.sent_args += len(piece)
            calls.append(ToolCallDelta(call.index, arguments=piece))

    def _close_call(
        self, call: _Call, content: list[str], calls: list[ToolCallDelta], *, cut: bool
    ) -> bool:
        """Finish ``call``; False if it was no call after all (its text became content).

        True also for a call that is dropped: a word-for-word repeat of an earlier call,
        or one the budget cut before its name was sent, after earlier calls (its text
        is a fragment of a call, not content)."""
        scanner = call.scanner
        parsed = None if cut else _loads(scanner.text)
        if call.id is None:
            # Never announced: a call only if the whole object says so.
            name = parsed.get("name") if isinstance(parsed, dict) else None
            if not isinstance(name, str):
                self._calls.pop()
                if cut and self._calls:
                    return True  # the budget cut a further call short: a fragment
                content.append(scanner.text)
                return False
            assert isinstance(parsed, dict)
            signature = self._signature(parsed)
            if any(c.signature == signature for c in self._calls[:-1]):
                self._calls.pop()  # the model repeating a call it made: not a new call
                return True
            call.id, call.name = self._new_id(self.fmt), name
            calls.append(ToolCallDelta(call.index, call.id, name, ""))
        if isinstance(parsed, dict):
            call.signature = self._signature(parsed)
        self._announce(call, calls)
        args = scanner.member(self._args_key) or scanner.member("arguments")
        if args is not None and scanner.text[args.start : args.start + 1] == '"':
            decoded = _loads(scanner.text[args.start : args.last])
            if isinstance(decoded, str) and call.sent_args == 0:
                call.sent_args = len(decoded)
                calls.append(ToolCallDelta(call.index, arguments=decoded))
        elif args is None and call.sent_args == 0:
            call.sent_args = 2
            calls.append(ToolCallDelta(call.index, arguments="{}"))
        return True

    def _signature(self, parsed: dict[str, Any]) -> str:
        """A whole call's name and arguments as canonical JSON (to find repeats)."""
        args = parsed.get(self._args_key, parsed.get("arguments"))
        if isinstance(args, str):  # arguments written as a JSON text
            decoded = _loads(args)
            args = args if decoded is None else decoded
        return json.dumps([parsed.get("name"), args], sort_keys=True)

    def _after_object(self, content: list[str], final: bool) -> bool:
        held = self._held.lstrip()
        if self.fmt is ToolCallFormat.HERMES:
            if held.startswith(HERMES_CLOSE):
                self._held = held[len(HERMES_CLOSE) :]
                self._region = _Region.TEXT
                return True
            if HERMES_CLOSE.startswith(held):
                if not final:
                    self._held = held
                    return False
                # `</tool_call` cut short by the budget: the call's own end, not content.
                self._held = ""
                self._region = _Region.TEXT
                return False
        elif self.fmt in _LISTS:
            if held.startswith(","):
                self._held = held[1:]
                self._region = _Region.BEFORE_OBJECT
                return True
            if held.startswith("]"):
                self._in_array = False
                self._held = held[1:]
                self._region = _Region.TEXT
                return True
            if not held and not final:
                self._held = ""
                return False
        else:  # llama3_json: calls separated by ';'
            if held.startswith(";"):
                self._held = held[1:]
                self._region = _Region.BEFORE_OBJECT
                return True
            if not held and not final:
                self._held = ""
                return False
        # Anything else after a call is plain content (whitespace between calls is not).
        self._held = held
        self._region = _Region.TEXT
        return bool(held)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# --------------------------------------------------------------------------- forcing a call


def tool_grammar(
    fmt: ToolCallFormat,
    tools: Sequence[Mapping[str, Any]],
    *,
    parallel: bool,
    marker_token_id: Callable[[str], int | None],
    json_options: Mapping[str, Any],
) -> str:
    """A Lark grammar (llguidance's dialect) that admits only calls to ``tools``.

    ``tools`` are OpenAI function definitions (``{"name", "parameters"}``); the call's
    arguments must be valid for the tool's ``parameters`` schema. ``parallel``: one or
    more calls, else exactly one. ``marker_token_id`` maps a marker to its token id
    when the marker is one added token, special or not (``Tokenizer.added_token_id``):
    the grammar names it by id, ``<[id]>``. Written as text instead, the marker is
    spelled by several tokens or by the one added token, and the matcher disagrees
    with the mask over the latter: every forced call on Qwen, whose ``<tool_call>``
    is an added token that is not special, failed so (issue 26). The ``json``
    format has no marker. ``json_options`` are the JSON spelling
    options (``constrained.JSON_OPTIONS``), so a forced call is spelled like any
    other constrained JSON.
    """
    key = ARGUMENTS_KEY[fmt]
    variants = []
    for tool in tools:
        params = tool.get("parameters") or {"type": "object"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": dict(json_options)}
    lines = [f"obj: %json {json.dumps(schema)}"]

    def literal(marker: str) -> str:
        tid = marker_token_id(marker)
        return f"<[{tid}]>" if tid is not None else json.dumps(marker)

    if fmt is ToolCallFormat.HERMES:
        lines.append(
            f"call: {literal(HERMES_OPEN)} {json.dumps(chr(10))} obj "
            f"{json.dumps(chr(10))} {literal(HERMES_CLOSE)}"
        )
        lines.append('start: call ("\\n" call)*' if parallel else "start: call")
    elif fmt is ToolCallFormat.MISTRAL:
        more = ' (", " obj)*' if parallel else ""
        lines.append(f'start: {literal(MISTRAL_TOOL_CALLS)} "[" obj{more} "]"')
    elif fmt is ToolCallFormat.JSON:
        more = ' (", " obj)*' if parallel else ""
        lines.append(f'start: "[" obj{more} "]"')
    else:
        lines.append('start: obj ("; " obj)*' if parallel else "start: obj")
    return "\n".join(reversed(lines))
