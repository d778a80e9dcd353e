"""Hostile request bodies against the live app: a shaped 4xx or a correct 200, never a
5xx, never a hang, and a neighbour stream beside each one completes correctly.

The hypothesis strategy draws whole bodies (wrong types, huge / negative / NaN
numbers, unknown fields, deep nesting, invalid UTF-8, lone surrogates, huge strings,
odd stop lists, token ids out of range, duplicate keys) and sends each as raw bytes.
One server serves every example (started once, in a thread of its own), so an
example costs one request and one short neighbour stream.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverkit import MODEL_ID, live_server

EXAMPLES = 60  # ~0.3 s each on this loaded 2-core machine
NEIGHBOUR = {
    "model": MODEL_ID,
    "prompt": "The neighbour",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


class ThreadServer:
    """A live server in its own thread and trio run, for sync (hypothesis) tests."""

    def __init__(self, loaded: Any, **kwargs: Any) -> None:
        self.loaded = loaded
        self.kwargs = kwargs
        self.ready = threading.Event()
        self.url = ""
        self.live: Any = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._stop = trio.Event()
            async with live_server(self.loaded, **self.kwargs) as live:
                self.live, self.url = live, live.url
                self.token = trio.lowlevel.current_trio_token()
                self.ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # reported by __enter__ / __exit__
            self.error = exc
            self.ready.set()

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        assert self.ready.wait(120), "the server did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.token is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self.thread.join(120)
        if self.error is not None:
            raise self.error

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` in the server's trio thread (to read its state safely)."""
        return trio.from_thread.run_sync(fn, trio_token=self.token)


@pytest.fixture(scope="module")
def server(loaded: Any) -> Iterator[ThreadServer]:
    with ThreadServer(loaded, slots=2, context_tokens=256) as s:
        yield s


def stream_text(client: httpx.Client, url: str) -> str:
    out = []
    with client.stream("POST", url + "/v1/completions", json=NEIGHBOUR) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                out.append(event["choices"][0]["text"])
    return "".join(out)


# ----------------------------------------------------------------------------- strategy

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "n",
    "echo",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "user",
    "ignore_eos",
    "logit_bias",
    "response_format",
    "no_such_field",
]

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 4, 1.0, 2.5, 1e308, -0.0, 10**400]),
)
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\ud800", "<|im_end|>", "x" * 20_000, "\x00", "stop"]),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "bad"]), "content": values}
    ),
    max_size=4,
)
token_ids = st.lists(st.integers(-5, 300_000), max_size=8)
field_values = {
    "prompt": st.one_of(texts, token_ids, st.lists(token_ids, max_size=2), values),
    "messages": st.one_of(messages, values),
    "stop": st.one_of(texts, st.lists(texts, max_size=8), values),
    "model": st.one_of(st.just(MODEL_ID), texts),
    "max_tokens": st.one_of(st.integers(-3, 40), numbers, values),
    "min_tokens": st.one_of(st.integers(-3, 40), numbers, values),
    "stop_token_ids": st.one_of(token_ids, values),
}
bodies = st.lists(st.sampled_from(FIELDS), unique=True, max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: field_values.get(k, values) for k in keys})
)


def encode(body: dict[str, Any], mutation: int) -> bytes:
    """The body as bytes, sometimes damaged the way JSON on the wire can be."""
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    if mutation == 1:  # a duplicate key: the last one wins in Python's parser
        return data[:-1] + (b', "max_tokens": 2}' if len(data) > 2 else b'{"max_tokens": 2}')
    if mutation == 2:  # invalid UTF-8 inside a string
        return data.replace(b'"', b'"\xff', 1)
    if mutation == 3:  # deep nesting
        return b'{"prompt": "x", "user": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    if mutation == 4:  # an integer past Python's int-string limit (4,300 digits)
        return b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}"
    if mutation == 5:  # cut short
        return data[: len(data) // 2]
    return data


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=bodies, mutation=st.integers(0, 8), chat=st.booleans())
def test_a_hostile_body_gets_a_shaped_4xx_or_a_200_and_its_neighbour_completes(
    server, body, mutation, chat
):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = encode(body, mutation)
    expected = getattr(server, "neighbour_text", None)
    with httpx.Client(timeout=60) as client:
        if expected is None:
            server.neighbour_text = expected = stream_text(client, server.url)
        neighbour: list[str] = []
        t = threading.Thread(target=lambda: neighbour.append(stream_text(client, server.url)))
        t.start()
        r = client.post(
            server.url + path, content=data, headers={"content-type": "application/json"}
        )
        t.join(60)
    assert not t.is_alive(), "the neighbour stream hung"
    assert neighbour == [expected], "the neighbour's greedy text changed"
    assert r.status_code < 500, r.text[:500]
    if r.status_code == 200:
        payload = r.text
        if body.get("stream") is True:
            assert payload.rstrip().endswith("data: [DONE]")
        else:
            obj = r.json()
            assert obj["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert 400 <= r.status_code < 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert len(r.content) < 4096, "the error body echoes too much of the request"


def test_after_the_hostile_bodies_the_server_is_at_rest(server):
    live = server.live
    assert server.call(live.pool_is_idle)
    assert server.call(lambda: live.service.live_requests) == 0


# ----------------------------------------------------------------------------- parser rules


def refusal(raw: bytes) -> Any:
    from triollm.server.openai import ApiError, parse_completion

    with pytest.raises(ApiError) as info:
        parse_completion(raw)
    return info.value


def test_an_integer_past_the_digit_limit_is_a_400_naming_the_limit():
    # Before: Python's int-string limit (4,300 digits) surfaced as a 500.
    err = refusal(b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}")
    assert err.status == 400 and err.code == "invalid_json"
    assert "5000 digits" in err.message and "at most 100" in err.message


def test_an_error_message_quotes_a_huge_value_only_in_part():
    from triollm.server.openai import MAX_ERROR_MESSAGE_CHARS

    err = refusal(b'{"prompt": "x", "best_of": "' + b"n" * 3_000_000 + b'"}')
    assert err.param == "best_of"
    assert len(err.message) <= MAX_ERROR_MESSAGE_CHARS and "characters in all" in err.message


def test_integral_floats_follow_one_rule_everywhere():
    from triollm.server.openai import parse_completion

    req = parse_completion(b'{"prompt": [1, 2.0], "max_tokens": 4.0, "n": 1.0, "seed": 7.0}')
    assert req.prompt_ids == (1, 2) and req.max_tokens == 4 and req.seed == 7
    for raw, param in (
        (b'{"prompt": "x", "max_tokens": 4.5}', "max_tokens"),
        (b'{"prompt": "x", "n": 1.5}', "n"),
        (b'{"prompt": "x", "logprobs": 2.5}', "logprobs"),
    ):
        assert refusal(raw).param == param


def test_a_token_list_with_a_fraction_names_the_element_not_a_count():
    err = refusal(b'{"prompt": [1, 2.5]}')
    assert err.param == "prompt" and "prompt[1] is 2.5" in err.message
    assert "one prompt" not in err.message


# ----------------------------------------------------------------------------- long prompts


async def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(loaded, monkeypatch):
    calls: list[int] = []
    encode = loaded.tokenizer.encode
    monkeypatch.setattr(
        loaded.tokenizer, "encode", lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
    )
    async with live_server(loaded, max_body_bytes=16 * 2**20) as live:
        per_token = loaded.tokenizer.max_chars_per_token
        huge = "word " * (2 * per_token * 256 // 5 + 10)  # at least 256 tokens: cannot fit
        for path, body in (
            ("/v1/completions", {"prompt": huge}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ):
            r = await trio.to_thread.run_sync(
                lambda p=path, b=body: httpx.post(live.url + p, json=b, timeout=60)
            )
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded"
            assert "maximum context length of 256 tokens" in err["message"]
        assert all(n < len(huge) for n in calls)  # the huge text never reached encode


async def test_tokenizing_runs_off_the_event_loop_so_a_neighbour_streams_meanwhile(
    loaded, monkeypatch
):
    release = threading.Event()
    entered = threading.Event()
    encode = loaded.tokenizer.encode

    def slow_encode(text: str, **kw: Any) -> list[int]:
        if text == "the slow one":
            entered.set()
            # A tokenizer busy with a long prompt, held by the test until the neighbour
            # has streamed. On the event loop, nothing could stream: it gives up.
            if not release.wait(20):
                raise RuntimeError("the neighbour never streamed while this one tokenized")
        return encode(text, **kw)

    monkeypatch.setattr(loaded.tokenizer, "encode", slow_encode)
    async with live_server(loaded) as live:

        def slow_request() -> int:
            body = {"prompt": "the slow one", "max_tokens": 2}
            return httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code

        async with trio.open_nursery() as nursery:
            statuses: list[int] = []

            async def slow() -> None:
                statuses.append(await trio.to_thread.run_sync(slow_request))

            nursery.start_soon(slow)
            await trio.to_thread.run_sync(entered.wait, 60)
            # The slow tokenization is in progress; on the event loop it would block
            # everything, and this stream could not even start.
            with httpx.Client(timeout=60) as client:
                text = await trio.to_thread.run_sync(stream_text, client, live.url)
            assert text
            release.set()
        assert statuses == [200]


def test_the_default_body_limit_is_sized_to_the_context(loaded):
    from serverkit import stack_for

    from triollm.server.app import MIN_BODY_LIMIT_BYTES, body_limit_for

    stack = stack_for(loaded, slots=2, context_tokens=256)
    limit = stack.max_body_bytes
    assert limit == body_limit_for(256, loaded.tokenizer.max_chars_per_token)
    assert limit == MIN_BODY_LIMIT_BYTES  # 256 positions: the 1 MiB floor, not 8 MiB
    assert body_limit_for(32768, 16) > MIN_BODY_LIMIT_BYTES  # a long context gets more
