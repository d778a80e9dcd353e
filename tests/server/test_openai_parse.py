"""Request parsing and validation: every refusal names its field."""

from __future__ import annotations

import json

import pytest

from triollm.server import sse
from triollm.server.openai import ApiError, parse_chat, parse_completion


def completion(**fields):
    return parse_completion(json.dumps({"model": "m", "prompt": "hi"} | fields).encode())


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    return parse_chat(json.dumps(body).encode())


def refused(call, **fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(**fields)
    assert info.value.status == 400
    return info.value


def test_a_full_completion_request_parses_into_a_frozen_request():
    req = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=3,
        stop=["\n", "END"],
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        repetition_penalty=1.1,
        logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        user="alice",
    )
    assert (req.kind, req.prompt_text, req.max_tokens, req.top_k, req.seed) == (
        "completion",
        "hi",
        7,
        40,
        3,
    )
    assert req.stop == ("\n", "END") and req.logprobs == 2 and req.include_usage
    with pytest.raises(AttributeError):
        req.max_tokens = 8  # type: ignore[misc]


def test_prompt_forms():
    assert completion(prompt=[1, 2, 3]).prompt_ids == (1, 2, 3)
    assert completion(prompt=["one"]).prompt_text == "one"
    assert completion(prompt=[[4, 5]]).prompt_ids == (4, 5)
    assert refused(completion, prompt=["a", "b"]).param == "prompt"
    assert refused(completion, prompt="").param == "prompt"
    assert refused(completion, prompt=[1, -2]).param == "prompt"
    assert refused(completion, prompt=None).param == "prompt"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", True),
        ("max_tokens", "5"),
        ("temperature", "hot"),
        ("top_p", "0.5"),
        ("top_k", 2.5),
        ("seed", "7"),
        ("logprobs", 6),
        ("stream", "yes"),
        ("n", 0),
        ("n", 129),
        ("n", True),
        ("best_of", 3),
        ("echo", "yes"),
        ("suffix", "x"),
        ("logit_bias", {"5": 1}),
        ("stop", ["a"] * 17),
        ("stop", [""]),
        ("stop", 5),
        ("user", 7),
    ],
)
def test_a_bad_field_is_refused_by_name(field, value):
    assert refused(completion, **{field: value}).param == field


def test_stream_options_need_stream():
    assert refused(completion, stream_options={"include_usage": True}).param == "stream_options"


def test_max_tokens_and_max_completion_tokens():
    assert completion(max_completion_tokens=9).max_tokens == 9
    assert completion(max_tokens=9, max_completion_tokens=9).max_tokens == 9
    assert refused(completion, max_tokens=9, max_completion_tokens=8).param == (
        "max_completion_tokens"
    )


def test_invalid_json_and_non_objects():
    for raw in (b"{", b"[1]", b"\xff\xfe"):
        with pytest.raises(ApiError) as info:
            parse_completion(raw)
        assert info.value.status == 400 and info.value.code == "invalid_json"
    with pytest.raises(ApiError) as info:
        parse_completion(b'{"model": 7, "prompt": "x"}')
    assert info.value.param == "model"


def test_a_missing_model_means_the_served_one():
    assert parse_completion(b'{"prompt": "x"}').model is None


def test_chat_messages_and_logprobs():
    req = chat(logprobs=True, top_logprobs=3)
    assert req.messages[0].role == "user" and req.logprobs == 3
    assert chat(logprobs=True).logprobs == 0
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert parts.messages[0].content == "a"
    assert refused(chat, top_logprobs=2).param == "top_logprobs"
    assert refused(chat, messages=[]).param == "messages"
    assert refused(chat, messages=[{"role": "robot", "content": "x"}]).param == ("messages[0].role")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    assert refused(chat, messages=image).param == "messages[0].content"
    assert refused(chat, tools=[{"type": "function"}]).param == "tools[0].function"


def test_error_body_is_openai_shaped():
    err = refused(completion, n=0)
    body = err.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


def test_sse_events_are_single_lines_and_round_trip():
    ev = sse.event({"text": "line one\nline two", "emoji": "é"})
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    assert ev.count(b"\n") == 2  # the newline inside the text is escaped
    assert sse.parse_events(ev + sse.DONE) == [
        json.dumps(
            {"text": "line one\nline two", "emoji": "é"}, separators=(",", ":"), ensure_ascii=False
        ),
        "[DONE]",
    ]
    err = sse.error_event("boom", type="server_error", code="too_slow")
    assert json.loads(err[len(b"data: ") :])["error"]["code"] == "too_slow"


def test_lone_surrogates_are_refused_naming_the_field():
    lone = '"\\ud800"'  # a JSON escape that decodes to an unencodable str
    cases = [
        (parse_completion, '{"prompt": LONE}', "prompt"),
        (parse_completion, '{"prompt": "hi", "model": LONE}', "model"),
        (parse_completion, '{"prompt": "hi", "stop": [LONE]}', "stop"),
        (parse_chat, '{"messages": [{"role": "user", "content": LONE}]}', "messages[0].content"),
    ]
    for parse, body, param in cases:
        with pytest.raises(ApiError) as info:
            parse(body.replace("LONE", lone).encode())
        assert info.value.status == 400 and info.value.param == param, body


def test_a_deeply_nested_body_is_a_400_not_a_crash():
    with pytest.raises(ApiError) as info:
        parse_completion(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert info.value.status == 400 and info.value.code == "invalid_json"


def test_a_5xx_http_error_is_a_server_error_not_the_clients():
    from werkzeug.exceptions import NotFound, ServiceUnavailable

    from triollm.server.app import http_error

    assert http_error(ServiceUnavailable()).type == "server_error"
    assert http_error(ServiceUnavailable()).status == 503
    assert http_error(NotFound()).type == "invalid_request_error"


def test_a_prompt_of_the_wrong_type_says_so_rather_than_required():
    for prompt, word in ((5, "int"), ([1.5], "1.5"), ({"a": 1}, "dict")):
        err = refused(completion, prompt=prompt)
        assert err.param == "prompt" and word in err.message and "required" not in err.message
    assert "required" in refused(lambda: parse_completion(b'{"model": "m"}')).message


def test_sampling_ranges_are_left_to_sampling_params():
    # One owner for the ranges (model/sampling.py); the parser checks JSON types only.
    # tests/server/test_http_edges.py proves the refusal still reaches the client.
    req = completion(top_p=0, temperature=9, repetition_penalty=0, seed=2**70, top_k=-1)
    assert (req.top_p, req.temperature, req.repetition_penalty) == (0.0, 9.0, 0.0)
    assert req.seed == 2**70 and req.top_k == 0  # -1 is vLLM's spelling of "off"


def test_include_usage_errors_are_named_precisely():
    err = refused(completion, stream=True, stream_options={"include_usage": "yes"})
    assert err.param == "stream_options.include_usage"
    assert "'stream_options.include_usage'" in err.message


def test_priority_is_an_integer_and_zero_when_left_out():
    assert completion().priority == 0 and chat().priority == 0
    assert completion(priority=-3).priority == -3 and chat(priority=7).priority == 7
    for bad in ("high", True, 1.5, [1]):
        for call in (completion, chat):
            err = refused(call, priority=bad)
            assert err.param == "priority" and "'priority' must be an integer" in err.message


def test_n_is_the_number_of_choices_and_best_of_may_only_repeat_it():
    assert completion().n == 1
    assert completion(n=3).n == 3 and chat(n=3).n == 3
    assert completion(n=2, best_of=2).n == 2
    assert refused(completion, n=2, best_of=4).param == "best_of"
    assert "between 1 and 128" in refused(chat, n=200).message
