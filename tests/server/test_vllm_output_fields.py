"""vLLM's two output fields of issue 26: ``prompt_logprobs`` and ``skip_special_tokens``.

``prompt_logprobs: k`` returns, beside the answer, each prompt token's log-probability
and rank and the ``k`` likeliest tokens at its place, in vLLM's shape: a list per prompt
position, ``None`` for the first (nothing predicts it), each entry keyed by token id.
The scores are the ones ``echo`` with ``logprobs`` returns (one engine path, the scored
prompt), so the test holds the two answers to each other.

``skip_special_tokens: false`` keeps special tokens in the answer's text as their
strings. A grammar forces one (``<[3]>`` is ``<|im_start|>`` by id in the fixture's
vocabulary), so the test knows the exact text either way.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from serverkit import MODEL_ID, live_server
from test_echo_logprobs import greedy_ids

from triollm.server.openai import ApiError, parse_chat, parse_completion

PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."
USER = [{"role": "user", "content": "Say hi."}]
MARKER = 3  # <|im_start|>: a special token of the fixture's tokenizer, not an end id


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL_ID, **body}, timeout=60)


def streamed_text(url: str, path: str, body: dict[str, Any]) -> str:
    r = post(url, path, {**body, "stream": True})
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    text = ""
    for event in (json.loads(ln) for ln in lines if ln != "[DONE]"):
        for choice in event["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


def test_prompt_logprobs_is_refused_streamed_and_out_of_range() -> None:
    assert parse_completion(b'{"prompt": "x", "prompt_logprobs": 2}').prompt_logprobs == 2
    refused = (
        b'{"prompt": "x", "prompt_logprobs": 1, "stream": true}',
        b'{"prompt": "x", "prompt_logprobs": 21}',
        b'{"prompt": "x", "prompt_logprobs": -1}',
        b'{"prompt": "x", "prompt_logprobs": true}',
    )
    for body in refused:
        with pytest.raises(ApiError) as info:
            parse_completion(body)
        assert (info.value.status, info.value.param) == (400, "prompt_logprobs")


async def test_prompt_logprobs_are_the_echo_scores_in_vllms_shape(loaded):
    ids = loaded.tokenizer.encode(PROMPT)
    # The prompt ends with the model's own greedy tokens: there the rank must be 1.
    greedy = greedy_ids(loaded, ids, 3)
    ids = ids + greedy
    base = {"prompt": ids, "max_tokens": 2, "temperature": 0}
    async with live_server(loaded) as live:
        echo, got, bare = [
            await trio.to_thread.run_sync(post, live.url, "/v1/completions", {**base, **extra})
            for extra in (
                {"echo": True, "logprobs": 3},
                {"prompt_logprobs": 3},
                {"prompt_logprobs": 0},
            )
        ]
    assert echo.status_code == got.status_code == bare.status_code == 200, got.text
    lp = echo.json()["choices"][0]["logprobs"]
    choice = got.json()["choices"][0]
    # the answer is as without the field, and its own logprobs were not asked for
    echoed = loaded.tokenizer.decode(ids)
    assert choice["text"] == echo.json()["choices"][0]["text"][len(echoed) :]
    assert choice["logprobs"] is None
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    outside = 0
    for i in range(1, len(ids)):
        entry, own = scores[i], scores[i][str(ids[i])]
        assert next(iter(entry)) == str(ids[i])  # the prompt token first, as vLLM orders it
        assert own["logprob"] == lp["token_logprobs"][i]
        assert own["decoded_token"] == lp["tokens"][i]
        by_rank = sorted(v["rank"] for k, v in entry.items() if k != str(ids[i]))
        likelier = sum(v > own["logprob"] for v in lp["top_logprobs"][i].values())
        if own["rank"] <= 3:  # among the three likeliest: its place there
            assert own["rank"] == 1 + likelier
        else:  # past them: every one of the three was likelier
            assert likelier == 3
            outside += 1
        assert by_rank == [r for r in (1, 2, 3) if r != own["rank"]]
        top = sorted((v["logprob"] for v in entry.values() if v["rank"] <= 3), reverse=True)
        assert top == sorted(lp["top_logprobs"][i].values(), reverse=True)
        # k = 0: the prompt token alone, with the same rank
        assert bare.json()["choices"][0]["prompt_logprobs"][i] == {str(ids[i]): own}
    assert outside > 0  # the random fixture puts some prompt tokens past the top three
    assert [scores[i][str(t)]["rank"] for i, t in enumerate(greedy, len(ids) - 3)] == [1, 1, 1]


async def test_chat_prompt_logprobs_cover_the_rendered_conversation(loaded):
    async with live_server(loaded) as live:
        rendered = await trio.to_thread.run_sync(post, live.url, "/tokenize", {"messages": USER})
        body = {"messages": USER, "max_tokens": 2, "prompt_logprobs": 1}
        got = await trio.to_thread.run_sync(post, live.url, "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    ids = rendered.json()["tokens"]
    scores = got.json()["prompt_logprobs"]  # the body's, as vLLM's chat answers it
    assert len(scores) == len(ids) and scores[0] is None
    assert all(str(t) in entry for t, entry in zip(ids[1:], scores[1:], strict=True))


def test_skip_special_tokens_reads_as_a_switch() -> None:
    chat = b'{"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": false}'
    assert parse_chat(chat).skip_special_tokens is False
    assert parse_completion(b'{"prompt": "x"}').skip_special_tokens is True
    with pytest.raises(ApiError) as info:
        parse_completion(b'{"prompt": "x", "skip_special_tokens": "no"}')
    assert info.value.param == "skip_special_tokens"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_skip_special_tokens_false_keeps_a_special_token_in_the_text(loaded, path):
    marker = loaded.tokenizer.decode([MARKER], skip_special_tokens=False)
    assert marker == "<|im_start|>"
    said = {"prompt": "x"} if path == "/v1/completions" else {"messages": USER}
    body = {**said, "guided_grammar": f'start: "Hi" <[{MARKER}]> " there"', "max_tokens": 20}
    keep = {**body, "skip_special_tokens": False}
    async with live_server(loaded) as live:
        texts = []
        for b in (body, keep):
            r = await trio.to_thread.run_sync(post, live.url, path, b)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            texts.append(choice.get("text", choice.get("message", {}).get("content")))
            texts.append(await trio.to_thread.run_sync(streamed_text, live.url, path, b))
    assert texts == ["Hi there", "Hi there", f"Hi{marker} there", f"Hi{marker} there"]
