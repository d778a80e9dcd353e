"""The request fields of structured output and tool calling, read from an OpenAI body.

Everything here is shape checking: which fields a request may use to constrain its
answer, what their JSON must look like, and what they mean together. Compilation
(does the library accept this grammar?) happens later, off the event loop, in
``model/constrained.py``; both raise :class:`~triollm.errors.FieldError`, which the
HTTP edge turns into a 400 whose ``param`` is the field.

The constraint fields, at most one per request:

- ``response_format``: OpenAI's ``{"type": "text" | "json_object" | "json_schema"}``;
  ``json_schema`` holds ``{"name", "schema", "strict"}``. Chat and completions both.
- vLLM's names for the rest (so clients written for vLLM work unchanged):
  ``guided_json`` (a schema), ``guided_regex``, ``guided_choice`` (a list of strings),
  ``guided_grammar`` (a Lark grammar, or a llama.cpp GBNF one), and their current
  spelling ``structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}``.
- llama.cpp's: ``grammar`` (GBNF, or Lark) and ``json_schema`` (a schema), which
  llama-server's clients send; ignoring them answered free text (issue 26).

Tools (chat only): ``tools``, ``tool_choice`` (``none``, ``auto``, ``required``, or
``{"type": "function", "function": {"name": ...}}``), ``parallel_tool_calls``. The
deprecated ``functions`` / ``function_call`` are refused by name: answering an old
agent with plain text it cannot act on would be a silent failure.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from triollm.errors import FieldError
from triollm.request import GrammarKind, GrammarSpec, check_limits
from triollm.toolcalls import ToolChoice, Tools

# The top-level vLLM fields, and the keys of structured_outputs, with what they hold.
_GUIDED = {
    "guided_json": GrammarKind.JSON_SCHEMA,
    "guided_regex": GrammarKind.REGEX,
    "guided_choice": GrammarKind.CHOICE,
    "guided_grammar": GrammarKind.LARK,
}
_STRUCTURED_OUTPUTS = {
    "json": GrammarKind.JSON_SCHEMA,
    "regex": GrammarKind.REGEX,
    "choice": GrammarKind.CHOICE,
    "grammar": GrammarKind.LARK,
}
# llama.cpp's top-level names (llama-server reads them on its OpenAI endpoints too).
_LLAMA_CPP = {"grammar": GrammarKind.LARK, "json_schema": GrammarKind.JSON_SCHEMA}
MAX_CHOICES = 1024  # a choice list past this is a grammar, not a list (and a big mask)


def _source(kind: GrammarKind, value: Any, field: str) -> Any:
    """Check the JSON type a constraint's value must have."""
    if kind is GrammarKind.JSON_SCHEMA:
        if isinstance(value, str):  # vLLM accepts a schema as a JSON string too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldError(field, f"'{field}' is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise FieldError(field, f"'{field}' must be a JSON Schema object")
        return value
    if kind is GrammarKind.CHOICE:
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise FieldError(field, f"'{field}' must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise FieldError(
                field, f"'{field}' may hold at most {MAX_CHOICES} choices, got {len(value)}"
            )
        return tuple(value)
    if not isinstance(value, str) or not value:
        raise FieldError(field, f"'{field}' must be a non-empty string")
    return value


def _response_format(value: Any) -> GrammarSpec | None:
    field = "response_format"
    if not isinstance(value, dict):
        raise FieldError(field, "'response_format' must be an object with a 'type'")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, None, field)
    if kind != "json_schema":
        raise FieldError(
            f"{field}.type",
            f"'response_format.type' must be text, json_object or json_schema; got {kind!r}",
        )
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise FieldError(
            f"{field}.json_schema",
            "'response_format.json_schema' must be an object with 'name' and 'schema'",
        )
    name = inner.get("name")
    if name is not None and not isinstance(name, str):
        raise FieldError(
            f"{field}.json_schema.name", "'response_format.json_schema.name' must be a string"
        )
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError(
            f"{field}.json_schema.strict",
            "'response_format.json_schema.strict' must be true or false",
        )
    # OpenAI lets 'schema' be absent (any JSON); we treat that as any JSON object.
    schema = inner.get("schema", {"type": "object"})
    where = f"{field}.json_schema.schema"
    return GrammarSpec(
        GrammarKind.JSON_SCHEMA, _source(GrammarKind.JSON_SCHEMA, schema, where), where
    )


def grammar_spec(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The one constraint a request asks for, or None. Two at once is a 400."""
    found: list[GrammarSpec] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(spec)
    for name, kind in {**_GUIDED, **_LLAMA_CPP}.items():
        if body.get(name) is not None:
            found.append(GrammarSpec(kind, _source(kind, body[name], name), name))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise FieldError("structured_outputs", "'structured_outputs' must be an object")
        for name, kind in _STRUCTURED_OUTPUTS.items():
            if outputs.get(name) is not None:
                where = f"structured_outputs.{name}"
                found.append(GrammarSpec(kind, _source(kind, outputs[name], where), where))
    if len(found) > 1:
        names = ", ".join(f"'{s.field.split('.')[0]}'" for s in found)
        raise FieldError(found[1].field, f"give one output constraint, not several ({names})")
    return found[0] if found else None


# --------------------------------------------------------------------------- tools


def _tool(index: int, item: Any) -> dict[str, Any]:
    field = f"tools[{index}]"
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise FieldError(field, f"'{field}' must be an object with type 'function'")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise FieldError(f"{field}.function", f"'{field}.function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise FieldError(
            f"{field}.function.name", f"'{field}.function.name' must be a non-empty string"
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise FieldError(
            f"{field}.function.parameters",
            f"'{field}.function.parameters' must be a JSON Schema object",
        )
    if params is not None:
        # A schema like any other: its depth, size and patterns are bounded before a
        # forced call compiles it, or the template renders it (a 1,000-deep $ref chain
        # here crashed the grammar compiler; issue 28).
        check_limits(GrammarSpec(GrammarKind.JSON_SCHEMA, params, f"{field}.function.parameters"))
    return {"type": "function", "function": fn}


def tools(body: Mapping[str, Any]) -> Tools | None:
    """The request's tools and tool choice, or None when it gives no tools."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise FieldError(old, f"'{old}' is deprecated and not supported; send 'tools' instead")
    raw = body.get("tools")
    choice_raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    if raw is None or raw == []:
        if choice_raw not in (None, "none"):
            raise FieldError("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(raw, list):
        raise FieldError("tools", "'tools' must be a list of function tools")
    definitions = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [d["function"]["name"] for d in definitions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise FieldError("tools", f"'tools' names the function {dup!r} twice")
    named = None
    if choice_raw is None:
        choice = ToolChoice.AUTO
    elif isinstance(choice_raw, str) and choice_raw in ("none", "auto", "required"):
        choice = ToolChoice(choice_raw)
    elif isinstance(choice_raw, dict):
        fn = choice_raw.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice_raw.get("type") != "function" or not isinstance(named, str):
            raise FieldError(
                "tool_choice",
                "'tool_choice' must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
            )
        if named not in names:
            raise FieldError(
                "tool_choice", f"'tool_choice' names {named!r}, which is not in 'tools'"
            )
        choice = ToolChoice.NAMED
    else:
        raise FieldError(
            "tool_choice",
            f"'tool_choice' must be none, auto, required or a function; got {choice_raw!r}",
        )
    return Tools(definitions, choice, named, True if parallel is None else parallel)


# --------------------------------------------------------------------------- messages


def message_tool_fields(param: str, role: str, item: Mapping[str, Any]) -> dict[str, Any]:
    """The tool-related fields of one chat message, ready for the chat template.

    ``tool_call_id`` (and ``name``) on a ``tool`` result; ``tool_calls`` on an assistant
    turn, with each call's ``arguments`` turned from its JSON text into an object, as
    transformers' templates (Qwen, Llama 3, Mistral) expect to ``tojson`` it.
    """
    out: dict[str, Any] = {}
    name = item.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise FieldError(f"{param}.name", f"'{param}.name' must be a string")
        out["name"] = name
    if role == "tool":
        call_id = item.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise FieldError(
                f"{param}.tool_call_id", f"'{param}.tool_call_id' is required for a tool result"
            )
        out["tool_call_id"] = call_id
    calls = item.get("tool_calls")
    if calls is not None and role == "assistant":
        if not isinstance(calls, list):
            raise FieldError(f"{param}.tool_calls", f"'{param}.tool_calls' must be a list")
        rendered = []
        for j, call in enumerate(calls):
            where = f"{param}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise FieldError(where, f"'{where}' must be a function call with a 'name'")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                # Not JSON: the template gets the text as it is.
                with contextlib.suppress(json.JSONDecodeError):
                    args = json.loads(args) if args.strip() else {}
            rendered.append(
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args},
                }
            )
        out["tool_calls"] = rendered
    return out
