"""Every request field is honoured, accepted or refused by name: the table and its promises.

``triollm.server.openai.FIELDS`` is the one list. Each row is sent here: a refused
field is a 400 whose ``param`` names it, an honoured or accepted one parses, and a
field of the other endpoint is refused there. docs/serving.md's parameter table is
the table's own output. Then the fields that were silently ignored before issue 26
and are honoured now, each checked for its effect.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverkit import MODEL_DIR, live_server

from triollm.request import GrammarKind
from triollm.server.apifields import UnknownFields
from triollm.server.openai import (
    COMPLETION,
    ENDPOINT_HEADINGS,
    FIELDS,
    ApiError,
    Support,
    field_table,
    parse_chat,
    parse_completion,
)

ROOT = Path(__file__).resolve().parents[2]
PARSE = {"chat": parse_chat, COMPLETION: parse_completion}
USER = [{"role": "user", "content": "hi"}]
BASE = {"chat": {"messages": USER}, COMPLETION: {"prompt": "hi"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# A value that asks for something, for each row (a refused row is refused with it).
ASKING: dict[str, Any] = {
    "logit_bias": {"1": 5},
    "modalities": ["text", "audio"],
    "typical_p": 0.5,
    "mirostat": 2,
    "dry_multiplier": 0.8,
    "xtc_probability": 0.5,
    "top_n_sigma": 1.5,
    "n_probs": 3,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "return_tokens_as_token_ids": True,
    "skip_special_tokens": False,
    "continue_final_message": True,
    "add_generation_prompt": False,
    "echo": True,
}
# A valid value for each honoured or accepted row, with the fields it needs beside it.
VALID: dict[str, dict[str, Any]] = {
    "model": {"model": "m"},
    "messages": {"messages": USER},
    "prompt": {"prompt": "hi"},
    "max_tokens": {"max_tokens": 5},
    "max_completion_tokens": {"max_completion_tokens": 5},
    "n": {"n": 2},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "seed": {"seed": 1},
    "presence_penalty": {"presence_penalty": 0.1},
    "frequency_penalty": {"frequency_penalty": 0.1},
    "stop": {"stop": ["x"]},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "echo": {"echo": True},
    "best_of": {"best_of": 1},
    "response_format": {"response_format": {"type": "json_object"}},
    "tools": {"tools": TOOLS},
    "tool_choice": {"tools": TOOLS, "tool_choice": "required"},
    "parallel_tool_calls": {"tools": TOOLS, "parallel_tool_calls": False},
    "user": {"user": "u"},
    "store": {"store": False},
    "metadata": {"metadata": {"a": "b"}},
    "service_tier": {"service_tier": "auto"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "safety_identifier": {"safety_identifier": "s"},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "min_tokens": {"min_tokens": 1},
    "stop_token_ids": {"stop_token_ids": [1]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "cache_salt": {"cache_salt": "s"},
    "priority": {"priority": 1},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "a+"},
    "guided_choice": {"guided_choice": ["a"]},
    "guided_grammar": {"guided_grammar": 'start: "a"'},
    "structured_outputs": {"structured_outputs": {"regex": "a"}},
    "continue_final_message": {
        "messages": [*USER, {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True,
    },
    "add_generation_prompt": {"add_generation_prompt": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 5},
    "skip_special_tokens": {"skip_special_tokens": False},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "n_predict": {"n_predict": 5},
    "repeat_penalty": {"repeat_penalty": 1.1},
    "grammar": {"grammar": 'root ::= "yes" | "no"'},
    "json_schema": {"json_schema": {"type": "object"}},
    "mirostat_tau": {"mirostat_tau": 5.0},
    "mirostat_eta": {"mirostat_eta": 0.1},
    "dry_base": {"dry_base": 1.75},
    "dry_allowed_length": {"dry_allowed_length": 2},
    "dry_penalty_last_n": {"dry_penalty_last_n": -1},
    "dry_sequence_breakers": {"dry_sequence_breakers": ["\n"]},
    "xtc_threshold": {"xtc_threshold": 0.1},
    "cache_prompt": {"cache_prompt": True},
}
# Completions' logprobs is a count; chat's a switch.
VALID_IN = {(COMPLETION, "logprobs"): {"logprobs": 2}, ("chat", "logprobs"): {"logprobs": True}}


def body(api: str, extra: dict[str, Any]) -> bytes:
    return json.dumps({**BASE[api], **extra}).encode()


def rows(*supports: Support) -> list[tuple[str, str]]:
    return [
        (api, name)
        for name, rule in FIELDS.items()
        if rule.support in supports
        for api in sorted(rule.apis)
    ]


def elsewhere() -> list[tuple[str, str]]:
    return [(api, name) for name, rule in FIELDS.items() for api in PARSE if api not in rule.apis]


@pytest.mark.parametrize(("api", "name"), rows(Support.REFUSED))
def test_a_refused_field_is_a_400_naming_it(api: str, name: str) -> None:
    with pytest.raises(ApiError) as info:
        PARSE[api](body(api, {name: ASKING.get(name, "x")}))
    assert (info.value.status, info.value.param) == (400, name)


@pytest.mark.parametrize(("api", "name"), elsewhere())
def test_a_field_of_the_other_endpoint_is_refused_there(api: str, name: str) -> None:
    with pytest.raises(ApiError) as info:
        PARSE[api](body(api, {name: ASKING.get(name, "x")}))
    assert (info.value.status, info.value.param) == (400, name)


@pytest.mark.parametrize(("api", "name"), rows(Support.HONOURED, Support.ACCEPTED))
def test_an_honoured_or_accepted_field_parses(api: str, name: str) -> None:
    PARSE[api](body(api, VALID_IN.get((api, name)) or VALID[name]))


def test_a_refused_field_holding_its_neutral_value_asks_for_nothing() -> None:
    neutral = {"typical_p": 1.0, "mirostat": 0, "skip_special_tokens": True, "logit_bias": {}}
    parse_chat(body("chat", {**neutral, "modalities": ["text"], "use_beam_search": False}))


def test_an_unknown_field_is_reported_ignored_and_logged_once_per_api(caplog) -> None:
    req = parse_chat(body("chat", {"frobnicate": 1}))
    assert req.unknown == ("frobnicate",)
    assert dataclasses.replace(req, unknown=()) == parse_chat(body("chat", {}))  # ignored
    log_once = UnknownFields()
    with caplog.at_level(logging.WARNING, logger="triollm.server"):
        for api in ("/v1/chat/completions", "/v1/chat/completions", "responses"):
            log_once.note(api, req.unknown)
    assert sum("frobnicate" in r.getMessage() for r in caplog.records) == 2  # once per API


def test_the_log_of_unknown_fields_remembers_a_bounded_number_of_names(caplog) -> None:
    log_once = UnknownFields()
    with caplog.at_level(logging.WARNING, logger="triollm.server"):
        log_once.note("chat", (f"f{i}" for i in range(UnknownFields.limit + 10)))
        log_once.note("chat", ["f0", "late"])
    assert len(caplog.records) == UnknownFields.limit


async def test_a_live_chat_request_logs_an_unknown_field_once(loaded, caplog):
    caplog.set_level(logging.WARNING, logger="triollm.server")
    async with live_server(loaded) as live, httpx.AsyncClient(base_url=live.url) as http:
        for _ in range(2):
            r = await http.post(
                "/v1/chat/completions",
                json={"messages": USER, "max_tokens": 1, "frobnicate": True},
                timeout=60,
            )
            assert r.status_code == 200, r.text
    assert sum("frobnicate" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("api", list(PARSE))
def test_the_endpoints_table_in_serving_md_is_the_code_table(api: str) -> None:
    page = (ROOT / "docs" / "serving.md").read_text()
    section = page[page.index(f"#### {ENDPOINT_HEADINGS[api]}\n") :].split("\n#", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table == field_table(api).splitlines()


# --------------------------------------------------------------------------- honoured now


def test_llama_cpps_spellings_are_the_same_fields() -> None:
    req = parse_completion(body(COMPLETION, {"n_predict": 7, "repeat_penalty": 1.3}))
    assert (req.max_tokens, req.repetition_penalty) == (7, 1.3)
    assert parse_completion(body(COMPLETION, {"n_predict": -1})).max_tokens is None
    grammar = parse_chat(body("chat", {"grammar": 'root ::= "yes" | "no"'})).grammar
    assert grammar is not None and (grammar.kind, grammar.field) == (GrammarKind.LARK, "grammar")
    schema = parse_chat(body("chat", {"json_schema": {"type": "object"}})).grammar
    assert schema is not None and schema.kind is GrammarKind.JSON_SCHEMA
    for extra, param in (
        ({"max_tokens": 5, "n_predict": 6}, "n_predict"),
        ({"repetition_penalty": 1.1, "repeat_penalty": 1.2}, "repeat_penalty"),
    ):
        with pytest.raises(ApiError) as info:
            parse_completion(body(COMPLETION, extra))
        assert info.value.param == param


@pytest.mark.parametrize(
    "extra",
    [
        {"continue_final_message": True},  # the last message is the user's
        {"continue_final_message": True, "add_generation_prompt": True},
    ],
)
def test_prefill_needs_a_final_assistant_message_and_no_new_turn(extra: dict) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat(body("chat", extra))
    assert info.value.param == "continue_final_message"


async def test_prefill_continues_the_assistants_text_and_truncation_keeps_the_end(loaded):
    from triollm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(MODEL_DIR)
    talk = [*USER, {"role": "assistant", "content": "The colour is"}]
    async with live_server(loaded) as live, httpx.AsyncClient(base_url=live.url) as http:
        prefill = await http.post(
            "/tokenize", json={"messages": talk, "continue_final_message": True}
        )
        new_turn = await http.post("/tokenize", json={"messages": talk})
        whole = await http.post("/tokenize", json={"prompt": "a b c d e f g h i j"})
        cut = await http.post(
            "/tokenize", json={"prompt": "a b c d e f g h i j", "truncate_prompt_tokens": 3}
        )
    ids = prefill.json()["tokens"]
    assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\nThe colour is")
    assert not tok.decode(new_turn.json()["tokens"], skip_special_tokens=False).endswith("is")
    assert cut.json()["tokens"] == whole.json()["tokens"][-3:]
