"""`echo` with `logprobs` on /v1/completions: the prompt's log-probabilities, as
evaluation harnesses (lm-eval's loglikelihood and multiple-choice tasks) read them."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest
import trio
from serverkit import MODEL_ID, live_server

from triollm.batch import Batch
from triollm.kv import blocks_for
from triollm.model.sampling import SamplingParams
from triollm.plan import ChunkPlan, StepPlan
from triollm.server.openai import ApiError, parse_chat, parse_completion
from triollm.spec import GenerationSpec

PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL_ID, **body}, timeout=60)


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed completion, [DONE] left out."""
    r = post(url, {**body, "stream": True})
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


def greedy_ids(loaded: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, through a Batch of their own."""
    batch = Batch(loaded, num_blocks=blocks_for(len(prompt) + n, 16), block_size=16)
    batch.add(0, GenerationSpec(prompt, SamplingParams(temperature=0.0)))
    table = tuple(range(batch.num_blocks))
    chunk = ChunkPlan(0, tuple(prompt), 0, table, sample=True, prefill=True)
    out: list[int] = []
    for step in range(n):
        (token,) = batch.run(StepPlan(step, (chunk,))).sampled
        out.append(token.token_id)
        chunk = ChunkPlan(0, (token.token_id,), len(prompt) + step, table, True, False)
    return out


def test_max_tokens_zero_is_allowed_only_with_echo():
    assert parse_completion(b'{"prompt": "x", "echo": true, "max_tokens": 0}').max_tokens == 0
    assert parse_completion(b'{"prompt": "x", "echo": true, "logprobs": 1}').scores_prompt
    refused = (
        b'{"prompt": "x", "max_tokens": 0}',
        b'{"prompt": "x", "echo": false, "max_tokens": 0}',
    )
    for body in refused:
        with pytest.raises(ApiError) as info:
            parse_completion(body)
        assert info.value.param == "max_tokens" and "only for 'echo'" in info.value.message
    with pytest.raises(ApiError) as info:
        parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}')
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(ApiError) as info:
        parse_chat(b'{"messages": [{"role": "user", "content": "x"}], "echo": true}')
    assert info.value.param == "echo"


async def test_echo_with_logprobs_and_max_tokens_zero_returns_every_prompt_token(loaded):
    tok = loaded.tokenizer
    ids = tok.encode(PROMPT)
    async with live_server(loaded) as live:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0}
        r = await trio.to_thread.run_sync(post, live.url, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids)
        assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]
        # Nothing predicts the first token: null, as OpenAI and vLLM answer.
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x < 0 for x in lp["token_logprobs"][1:])
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
        # text_offset indexes the echoed text, token by token.
        offsets = lp["text_offset"] + [len(PROMPT)]
        pieces = [PROMPT[a:b] for a, b in itertools.pairwise(offsets)]
        special = tok.special_token_ids  # BOS: a token string, and no text in the echo
        assert pieces == ["" if i in special else t for i, t in zip(ids, lp["tokens"], strict=True)]
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 0)
        assert live.pool_is_idle()


async def test_the_prompt_s_logprobs_are_followed_by_the_answer_s_whole_and_streamed(loaded):
    async with live_server(loaded) as live:
        base = {"prompt": PROMPT, "logprobs": 1, "max_tokens": 5, "temperature": 0}
        plain = (await trio.to_thread.run_sync(post, live.url, base)).json()["choices"][0]
        echoed = (await trio.to_thread.run_sync(post, live.url, {**base, "echo": True})).json()
        choice = echoed["choices"][0]
        assert choice["text"] == PROMPT + plain["text"]
        lp, answer = choice["logprobs"], plain["logprobs"]
        n = len(lp["tokens"]) - len(answer["tokens"])
        assert lp["tokens"][n:] == answer["tokens"]
        assert lp["token_logprobs"][n:] == pytest.approx(answer["token_logprobs"], abs=1e-5)
        # The answer's offsets continue after the echoed prompt.
        assert lp["text_offset"][n:] == [len(PROMPT) + o for o in answer["text_offset"]]
        # Streamed: the first event carries the echoed prompt with its logprobs (as vLLM
        # sends them), the events together make the whole answer.
        stream = await trio.to_thread.run_sync(events, live.url, {**base, "echo": True})
        first = stream[0]["choices"][0]
        assert first["text"].startswith(PROMPT)
        assert first["logprobs"]["token_logprobs"][0] is None
        assert len(first["logprobs"]["tokens"]) >= n
        joined = {k: [v for e in stream for v in e["choices"][0]["logprobs"][k]] for k in lp}
        assert "".join(e["choices"][0]["text"] for e in stream) == choice["text"]
        assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
        assert joined["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


async def test_lm_eval_s_loglikelihood_request_scores_a_greedy_continuation(loaded):
    """lm-eval's local-completions payload for loglikelihood (token ids, echo, logprobs 1,
    max_tokens 1), read the way its parse_logprobs reads it: the continuation's sum,
    and is_greedy (each token's logprob equals the best alternative's)."""
    tok = loaded.tokenizer
    context = tok.encode(PROMPT)
    async with live_server(loaded) as live:
        gen = {"prompt": [context], "max_tokens": 6, "temperature": 0, "logprobs": 0}
        greedy = (await trio.to_thread.run_sync(post, live.url, gen)).json()["choices"][0]
        continuation = greedy_ids(loaded, context, 6)  # the ids (the answer gives strings)
        assert tok.decode(continuation) == greedy["text"]
        payload = {
            "prompt": [context + continuation],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        for _ in range(2):  # the second time its prompt's blocks are in the prefix cache
            r = await trio.to_thread.run_sync(post, live.url, payload)
            choice = r.json()["choices"][0]
            ctxlen = len(context)
            logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            assert len(logprobs) == len(continuation)
            assert sum(logprobs) == pytest.approx(
                sum(greedy["logprobs"]["token_logprobs"][: len(continuation)]), abs=1e-4
            )
            assert all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_every_choice_of_n_carries_the_prompt_s_logprobs(loaded):
    """n > 1: the choices share the prompt's blocks (one writer computes them); each
    choice's answer still starts with every prompt token's entry."""
    async with live_server(loaded) as live:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "n": 2}
        body |= {"temperature": 0.8, "seed": 5}
        one = (await trio.to_thread.run_sync(post, live.url, {**body, "n": 1})).json()
        two = (await trio.to_thread.run_sync(post, live.url, body)).json()
        n_prompt = one["usage"]["prompt_tokens"]
        alone = one["choices"][0]["logprobs"]
        for choice in two["choices"]:
            assert choice["text"].startswith(PROMPT)
            lp = choice["logprobs"]
            assert lp["tokens"][:n_prompt] == alone["tokens"][:n_prompt]
            assert lp["token_logprobs"][0] is None
            assert lp["token_logprobs"][1:n_prompt] == pytest.approx(
                alone["token_logprobs"][1:n_prompt], abs=1e-5
            )
        stream = await trio.to_thread.run_sync(events, live.url, {**body, "max_tokens": 0})
        firsts = {}
        for e in stream:
            for c in e["choices"]:
                firsts.setdefault(c["index"], c)
        assert sorted(firsts) == [0, 1]
        for c in firsts.values():
            assert c["text"] == PROMPT and len(c["logprobs"]["tokens"]) == n_prompt
        assert live.pool_is_idle()
