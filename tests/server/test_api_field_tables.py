"""Every field of the translated APIs is honoured, accepted or refused by name.

Two claims, one per test: docs/serving.md's tables are the code's ``FieldTable``s
(each row's name, treatment and note), and each refused field, sent with a value that
asks for something, is a 400 naming it from its API's parser, while an accepted one
passes and an unknown one is only reported for the log.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from triollm.server.anthropic import MESSAGES_FIELDS, parse_messages
from triollm.server.apifields import FieldTable, Support
from triollm.server.embeddings import EMBEDDINGS_FIELDS, parse_embeddings
from triollm.server.ollama import CHAT_FIELDS, EMBED_FIELDS, GENERATE_FIELDS, OPTIONS
from triollm.server.ollama import parse_chat as ollama_chat
from triollm.server.ollama import parse_generate as ollama_generate
from triollm.server.openai import ApiError
from triollm.server.openai_responses import RESPONSES_FIELDS, parse_responses

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"

# (the heading of its table on the page, the table)
TABLES = {
    "`POST /v1/responses`": RESPONSES_FIELDS,
    "`POST /v1/messages`": MESSAGES_FIELDS,
    "Ollama `POST /api/chat`": CHAT_FIELDS,
    "Ollama `POST /api/generate`": GENERATE_FIELDS,
    "Ollama `options`": OPTIONS,
    "`POST /v1/embeddings`": EMBEDDINGS_FIELDS,
    "Ollama `POST /api/embed`": EMBED_FIELDS,
}
ROW = re.compile(r"^\| `([^`]+)` \| (honoured|accepted|refused) \| (.*) \|$")


def rows_under(heading: str) -> list[tuple[str, str, str]]:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"#### {heading}\n")
    section = text[start + 1 :].split("\n#", 1)[0]  # up to the next heading
    return [m.groups() for line in section.splitlines() if (m := ROW.match(line))]


@pytest.mark.parametrize("heading", list(TABLES))
def test_the_page_lists_every_field_as_the_code_treats_it(heading: str) -> None:
    table = TABLES[heading]
    listed = rows_under(heading)
    code = [(f.name, f.support.value, f.note) for f in table.fields]
    assert listed == code


def _sent(table: FieldTable) -> list[tuple[str, str]]:
    return [(table.api, f.name) for f in table.fields if f.support is Support.REFUSED]


class _Model:
    """What the Ollama parser reads of the served model: its id."""

    id = "m"


ASKS_FOR_SOMETHING = {"x-asks": "for something"}  # no refused field's harmless value


def _parse(api: str, extra: dict[str, Any]) -> Any:
    model: Any = _Model()
    if api == "responses":
        return parse_responses(json.dumps({"input": "hi", **extra}).encode())
    if api == "messages":
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
        return parse_messages(json.dumps(body).encode())
    if api == "ollama options":
        body = {"messages": [{"role": "user", "content": "hi"}], "options": extra}
        return ollama_chat(json.dumps(body).encode(), model)
    if api == "ollama chat":
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        return ollama_chat(json.dumps(body).encode(), model)
    if api == "ollama generate":
        return ollama_generate(json.dumps({"prompt": "hi", **extra}).encode(), model)
    raise AssertionError(api)


REFUSED = [
    pair
    for table in TABLES.values()
    if table not in (EMBEDDINGS_FIELDS, EMBED_FIELDS)
    for pair in _sent(table)
]


@pytest.mark.parametrize(("api", "name"), REFUSED)
def test_a_refused_field_is_a_400_naming_it(api: str, name: str) -> None:
    with pytest.raises(ApiError) as refused:
        _parse(api, {name: ASKS_FOR_SOMETHING})
    assert refused.value.status == 400
    full = f"options.{name}" if api == "ollama options" else name
    assert refused.value.param == full and f"'{full}'" in refused.value.message


@pytest.mark.parametrize(("api", "name"), REFUSED)
def test_a_refused_field_with_a_harmless_value_passes(api: str, name: str) -> None:
    table = {t.api: t for t in TABLES.values()}[api]
    for value in (None, *table[name].harmless):
        _parse(api, {name: value})


def test_an_unknown_field_is_reported_for_the_log_and_changes_nothing() -> None:
    plain = parse_responses(json.dumps({"input": "hi"}).encode())
    odd = parse_responses(json.dumps({"input": "hi", "frobnicate": 1}).encode())
    assert odd.unknown == ("frobnicate",) and plain.unknown == ()
    assert odd.request == plain.request


def test_embeddings_refuse_an_unknown_encoding_by_name() -> None:
    with pytest.raises(ApiError) as refused:
        parse_embeddings(json.dumps({"input": "hi", "encoding_format": "int8"}).encode(), 64)
    assert refused.value.param == "encoding_format"
