"""Which fields each translated API honours, accepts or refuses: one table per API.

The project's rule for a field a client sends: it is **honoured** (it changes the answer
as the API documents), **accepted** (read and allowed, because by its nature it changes
no token of the answer: a label, a storage hint, a thread count), or **refused** with a
400 that names it. Never silently ignored: a client that asked for ``top_logprobs`` and
got none would read the silence as an answer. A field no table lists is a field nobody
here knows (a newer client's, a typo); as vLLM does, it is ignored and logged once
(:class:`UnknownFields`), since refusing it would break every client one release ahead.

Each API's module (``openai_responses.py``, ``anthropic.py``, ``ollama.py``,
``embeddings.py``) holds its :class:`FieldTable`; docs/serving.md prints the same tables
and ``tests/server/test_api_field_tables.py`` holds the page to the code.

:class:`Reader` reads one JSON object's fields with the type checks every API shares,
each refusal an :class:`~triollm.server.openai.ApiError` whose ``param`` is the field's
full name (``options.temperature``), so each API's error shape can name it.

Trap: JSON ``true`` is a Python ``bool``, which is an ``int``: the integer readers check
for ``bool`` first (``"max_tokens": true`` would otherwise mean one token).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from triollm.server.openai import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    ApiError,
    Support,
    as_integer,
    bad_request,
    load_object,
    value_kind,
)
from triollm.server.openai import valid_text as text  # one owner of the Unicode rule

__all__ = [
    "Body",
    "Field",
    "FieldTable",
    "Reader",
    "Support",
    "UnknownFields",
    "refuse",
    "required",
    "text",
]

log = logging.getLogger("triollm.server")


# One treatment enum for every API's table (the OpenAI endpoints' FIELDS uses it too).


@dataclass(frozen=True, slots=True)
class Field:
    """One field of one API. ``harmless``: for a refused field, the values that ask
    for nothing this server does not do (``"background": false``); null is always
    harmless, as a client library that sends every field with its default does."""

    name: str
    support: Support
    note: str
    harmless: tuple[Any, ...] = ()


class FieldTable:
    """An API's fields: the table docs/serving.md prints, and the door each body passes."""

    def __init__(self, api: str, fields: Iterable[Field]) -> None:
        self.api = api
        self.fields = tuple(fields)
        self._by_name = {f.name: f for f in self.fields}
        if len(self._by_name) != len(self.fields):
            raise ValueError(f"{api}: a field is listed twice")

    def __getitem__(self, name: str) -> Field:
        return self._by_name[name]

    def names(self) -> frozenset[str]:
        return frozenset(self._by_name)

    def screen(self, body: Mapping[str, Any], prefix: str = "") -> tuple[str, ...]:
        """Refuse each refused field whose value asks for something (400 naming it);
        return the names of the fields the table does not know, for the log."""
        unknown = []
        for name, value in body.items():
            spec = self._by_name.get(name)
            if spec is None:
                unknown.append(prefix + name)
                continue
            # `value in harmless` with 0 == False == 0.0: compare the types too.
            harmless = any(type(value) is type(h) and value == h for h in spec.harmless)
            if spec.support is Support.REFUSED and value is not None and not harmless:
                raise bad_request(
                    f"'{prefix}{name}' is not supported by this server: {spec.note}",
                    prefix + name,
                )
        return tuple(unknown)


class UnknownFields:
    """The one log of fields nobody here knows, for every API (the OpenAI endpoints'
    parsers report them in ``GenerationRequest.unknown``, the others' in
    ``Translation.unknown`` or their own request): each is ignored, as vLLM ignores
    it, and logged once per API and name, so a client misspelling a field learns it
    from the log and one that sends it with every request does not flood it. One per
    app (``Handlers.unknown``): the set lives as long as the server.

    Hazard: the names are the client's. At most :attr:`limit` are remembered, and
    each is cut to 80 characters in the log: a client inventing a new name per
    request cannot grow the set or the log line without bound."""

    limit = 256

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def note(self, api: str, names: Iterable[str]) -> None:
        for name in names:
            if (api, name) in self._seen or len(self._seen) >= self.limit:
                continue
            self._seen.add((api, name))
            log.warning("%s: ignoring the unknown field %r (logged once)", api, name[:80])


# --------------------------------------------------------------------------- readers


class Reader:
    """Typed reads of one JSON object's fields; ``prefix`` makes the names full
    (``Reader(options, "options.")`` names ``options.top_k``)."""

    def __init__(self, body: Mapping[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def param(self, name: str) -> str:
        return self.prefix + name

    def number(
        self, name: str, default: float, lo: float | None = None, hi: float | None = None
    ) -> float:
        """A JSON number. ``lo``/``hi`` only for limits the API itself sets (Anthropic's
        temperature is 0-1); the sampler's own ranges are ``SamplingParams``'."""
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(
                f"'{self.param(name)}' must be a number, got {type(value).__name__}",
                self.param(name),
            )
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise bad_request(
                f"'{self.param(name)}' must be between {lo} and {hi}, got {value}",
                self.param(name),
            )
        return float(value)

    def integer(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        value = as_integer(self.body.get(name))
        if value is None:
            return None
        full = self.param(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"'{full}' must be an integer, got {value_kind(value)}", full)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            limit = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise bad_request(f"'{full}' must be {limit}, got {value}", full)
        return int(value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            full = self.param(name)
            raise bad_request(f"'{full}' must be true or false, got {type(value).__name__}", full)
        return value

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is None:
            return None
        full = self.param(name)
        if not isinstance(value, str):
            raise bad_request(f"'{full}' must be a string, got {type(value).__name__}", full)
        return text(value, full)

    def obj(self, name: str) -> dict[str, Any] | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            full = self.param(name)
            raise bad_request(f"'{full}' must be an object, got {type(value).__name__}", full)
        return value

    def items(self, name: str) -> list[Any] | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            full = self.param(name)
            raise bad_request(f"'{full}' must be a list, got {type(value).__name__}", full)
        return value

    def stops(self, name: str) -> tuple[str, ...]:
        """Stop strings, under the bounds of /v1/chat/completions' ``stop``
        (``openai.MAX_STOP_SEQUENCES`` of at most ``MAX_STOP_CHARS`` each)."""
        value = self.body.get(name)
        if value is None:
            return ()
        full = self.param(name)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad_request(f"'{full}' must be a string or a list of strings", full)
        if len(items) > MAX_STOP_SEQUENCES:
            raise bad_request(
                f"'{full}' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}",
                full,
            )
        for s in items:
            text(s, full)
            if not s:
                raise bad_request(f"'{full}' sequences must not be empty", full)
            if len(s) > MAX_STOP_CHARS:
                raise bad_request(
                    f"'{full}' sequences may be at most {MAX_STOP_CHARS} characters, got {len(s)}",
                    full,
                )
        return tuple(items)


class Body(Reader):
    """One translated API's request body, read at its door (the one reader of the
    Responses, Messages, Ollama and embeddings parsers): the JSON object (else the 400
    ``invalid_json``), each refused field of ``table`` that asks for something refused
    by name (:meth:`FieldTable.screen`), and the names the table does not know kept in
    :attr:`unknown` for the log (``UnknownFields``). Its typed reads are
    :class:`Reader`'s."""

    body: dict[str, Any]  # the JSON object itself, for the API's own readers

    def __init__(self, raw: bytes, table: FieldTable) -> None:
        body = load_object(raw)
        super().__init__(body)
        self.unknown = table.screen(body)


def required(value: Any, param: str, what: str) -> Any:
    """A field the API requires: 400 naming it when it is missing."""
    if value is None:
        raise bad_request(f"'{param}' is required: {what}", param)
    return value


def refuse(param: str, why: str) -> ApiError:
    """The 400 for a value this server does not do (``messages[0].content[1].type``)."""
    return bad_request(f"'{param}' is not supported by this server: {why}", param)
