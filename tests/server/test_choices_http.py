"""``n`` over HTTP: several choices for one prompt, sharing the prompt's KV blocks.

Each choice is a sequence of one scheduler group (rule 10); the service streams them
into the request's one channel and the writer names each chunk's ``index``. Generation
is held still with a StepGate where a test looks at the pool mid-request; every wait is
on the service's own state changes.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import trio
from serverkit import MODEL_ID, StepGate, live_server, raw_post, read_until, sse_payloads

from triollm.kv import blocks_for
from triollm.outcomes import EndCode

PROMPT = list(range(5, 45))  # 40 token ids: in blocks of 8, four full ones and its own last
BLOCK = 8
SHARED = (len(PROMPT) - 1) // BLOCK  # 4 blocks the choices hold together


async def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.post(url + path, json=body, timeout=60))


def completion(**fields: Any) -> dict[str, Any]:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    return body | fields


def by_index(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        out.setdefault(choice["index"], []).append(choice)
    return out


async def test_three_streamed_choices_carry_their_index_each_ends_with_its_finish_and_one_usage(
    loaded,
):
    async with live_server(loaded, slots=3, block_size=BLOCK) as live:
        body = completion(n=3, stream=True, stream_options={"include_usage": True}, seed=1)
        r = await post(live.url, "/v1/completions", body)
        events = sse_payloads(r.content)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        usages = [e["usage"] for e in events[:-1] if not e["choices"]]
        choices = by_index(chunks)
        assert sorted(choices) == [0, 1, 2]
        for parts in choices.values():
            # Its own finish_reason, on its last chunk and only there.
            assert [c["finish_reason"] for c in parts][-1] == "length"
            assert all(c["finish_reason"] is None for c in parts[:-1])
        assert usages == [
            {
                "prompt_tokens": 40,  # once, though three choices read it
                "completion_tokens": 15,  # five for each choice
                "total_tokens": 55,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
        ]
        # The metrics: the prompt once, each choice a sequence that finished.
        sample = live.stack.metrics.registry.get_sample_value
        assert sample("triollm:prompt_tokens_total") == 40
        assert sample("triollm:generation_tokens_total") == 15
        assert sample("triollm:request_success_total", {"finished_reason": "length"}) == 3
        assert sample("triollm:request_params_n_sum") == 3
        assert sample("triollm:request_params_n_count") == 1
        assert live.pool_is_idle()


async def test_the_whole_body_lists_the_choices_in_index_order_with_the_usage_summed(loaded):
    async with live_server(loaded, slots=3, block_size=BLOCK) as live:
        r = await post(live.url, "/v1/completions", completion(n=3, logprobs=1, seed=4))
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        assert all(len(c["logprobs"]["tokens"]) == 5 for c in body["choices"])
        assert body["usage"]["prompt_tokens"] == 40
        assert body["usage"]["completion_tokens"] == 15
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # Again: the first choice finds the four full blocks in the cache, and the usage
        # says so once (the other choices read them from it too, but they are one prompt).
        again = (
            await post(live.url, "/v1/completions", completion(n=3, logprobs=1, seed=4))
        ).json()
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]


async def test_the_choices_hold_the_prompts_blocks_once_and_prefill_it_once(loaded):
    async with live_server(loaded, slots=3, block_size=BLOCK) as live:
        service = live.service
        gate = StepGate(service)
        before = len(service.recorder.records)
        sock = await raw_post(
            live.port, "/v1/completions", completion(n=3, max_tokens=6, stream=True)
        )
        await service.wait_until(lambda: service.scheduler.statistics().running == 3)
        whole = blocks_for(len(PROMPT) + 6, BLOCK)  # 6 blocks: the prompt's 5, one answer
        stats = service.scheduler.statistics()
        # One table's worth of prompt blocks, not three: 6 + 2 x (6 - 4) = 10, not 18.
        assert stats.blocks_held == whole + 2 * (whole - SHARED)
        tables = [service.scheduler.sequence(q).blocks for q in service.scheduler.running_ids()]
        assert tables[0][:SHARED] == tables[1][:SHARED] == tables[2][:SHARED]
        assert all(service.scheduler.pool.refcount(b) == 3 for b in tables[0][:SHARED])
        gate.open()
        buf = bytearray()
        assert await read_until(sock, b"data: [DONE]", buf)
        await sock.aclose()
        prefill = sum(r.prefill_rows for r in list(service.recorder.records)[before:])
        # The first choice computes 40 prompt rows, each other only its own last block.
        assert prefill == len(PROMPT) + 2 * (len(PROMPT) - SHARED * BLOCK)
        assert live.pool_is_idle()


async def test_a_seed_gives_each_choice_its_own_answer_and_the_same_answers_again(loaded):
    async with live_server(loaded, slots=2) as live:
        sampled = completion(n=2, max_tokens=12, temperature=1.0, seed=21)
        first = (await post(live.url, "/v1/completions", sampled)).json()
        again = (await post(live.url, "/v1/completions", sampled)).json()
        texts = [c["text"] for c in first["choices"]]
        assert texts[0] != texts[1]  # choice i samples with seed + i
        assert [c["text"] for c in again["choices"]] == texts
        # Choice 1 of seed 21 is choice 0 of seed 22: the seeds are seed + i.
        shifted = completion(max_tokens=12, temperature=1.0, seed=22)
        alone = (await post(live.url, "/v1/completions", shifted)).json()
        assert alone["choices"][0]["text"] == texts[1]
        greedy = completion(n=2, max_tokens=12, temperature=0)
        same = (await post(live.url, "/v1/completions", greedy)).json()
        assert same["choices"][0]["text"] == same["choices"][1]["text"]


async def test_a_client_that_hangs_up_mid_stream_frees_every_choices_blocks(loaded):
    async with live_server(loaded, slots=3, block_size=BLOCK) as live:
        service, metrics = live.service, live.stack.metrics
        gate = StepGate(service)
        body = completion(n=3, max_tokens=60, stream=True)
        sock = await raw_post(live.port, "/v1/completions", body)
        gate.allow(8)  # the prompt, then every choice's first tokens
        buf = bytearray()
        assert await read_until(sock, b'"finish_reason":null', buf)
        await service.wait_until(lambda: gate.parked)
        assert service.scheduler.statistics().running == 3
        await sock.aclose()  # hang up, the handler waiting on the request's channel
        await service.wait_until(lambda: metrics.rejection_count(EndCode.CLIENT_CLOSED) > 0)
        # One close ends them all, in the same call: all three counted, every block back.
        assert metrics.rejection_count(EndCode.CLIENT_CLOSED) == 3
        assert live.pool_is_idle()  # at once: no step has run since
        assert service.live_requests == 0
        gate.open()


async def test_n_past_the_bound_or_the_slots_and_best_of_unlike_n_are_refused_by_name(loaded):
    async with live_server(loaded, slots=2) as live:
        past_api = await post(live.url, "/v1/completions", completion(n=129))
        past_slots = await post(live.url, "/v1/completions", completion(n=3))
        best_of = await post(live.url, "/v1/completions", completion(n=2, best_of=3))
        equal = await post(live.url, "/v1/completions", completion(n=2, best_of=2))
    assert past_api.status_code == 400 and past_api.json()["error"]["param"] == "n"
    assert "between 1 and 128" in past_api.json()["error"]["message"]
    assert past_slots.status_code == 400 and past_slots.json()["error"]["param"] == "n"
    assert "more than the 2 slots" in past_slots.json()["error"]["message"]
    assert best_of.status_code == 400 and best_of.json()["error"]["param"] == "best_of"
    assert equal.status_code == 200 and len(equal.json()["choices"]) == 2


async def test_the_openai_client_gets_two_chat_choices_whole_and_streamed(loaded):
    async with live_server(loaded, slots=2) as live:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Say something."}]
        whole = await trio.to_thread.run_sync(
            lambda: c.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=6, n=2, seed=5
            )
        )
        assert [ch.index for ch in whole.choices] == [0, 1]
        assert all(ch.message.role == "assistant" for ch in whole.choices)

        def stream() -> tuple[dict[int, str], dict[int, str], Any]:
            texts: dict[int, str] = {}
            finish: dict[int, str] = {}
            usage = None
            for chunk in c.chat.completions.create(
                model=MODEL_ID,
                messages=messages,
                max_tokens=6,
                n=2,
                seed=5,
                stream=True,
                stream_options={"include_usage": True},
            ):
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                    if ch.finish_reason:
                        finish[ch.index] = ch.finish_reason
            return texts, finish, usage

        texts, finish, usage = await trio.to_thread.run_sync(stream)
        assert sorted(finish) == [0, 1]
        # The same seed gives the same two answers, streamed or whole.
        assert [texts[0], texts[1]] == [ch.message.content for ch in whole.choices]
        assert usage.completion_tokens == whole.usage.completion_tokens
        assert usage.prompt_tokens == whole.usage.prompt_tokens


async def test_every_choice_follows_the_grammar_with_its_own_matcher(loaded):
    async with live_server(loaded, slots=3) as live:
        options = ["alpha", "beta gamma", "delta"]
        body = {"model": MODEL_ID, "prompt": "Pick one:", "max_tokens": 20, "n": 3}
        r = await post(live.url, "/v1/completions", body | {"seed": 8, "guided_choice": options})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["text"] in options and choice["finish_reason"] == "stop"


async def test_a_preempted_choice_comes_back_alone_and_its_answer_is_unchanged(loaded):
    # 8 blocks of 16 positions hold the two choices' 60-token answers (4 blocks each)
    # but not a third request's too: the latest arrivals, the choices, are preempted,
    # recomputed and readmitted one by one.
    async with live_server(
        loaded, slots=3, policy="preempt", block_size=16, num_blocks=8, context_tokens=96
    ) as live:
        body = completion(prompt="The cat", max_tokens=60, temperature=1.0)
        other = completion(prompt="A dog", max_tokens=60, temperature=0)
        replies: dict[str, Any] = {}

        async def send(name: str, fields: dict[str, Any]) -> None:
            replies[name] = (await post(live.url, "/v1/completions", fields)).json()

        service = live.service
        gate = StepGate(service)  # all three start before anything runs
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "other", other)
            await service.wait_until(lambda: service.scheduler.statistics().running == 1)
            nursery.start_soon(send, "both", body | {"n": 2, "seed": 30})
            await service.wait_until(lambda: service.scheduler.statistics().running == 3)
            gate.open()
        assert service.scheduler.statistics().preemptions_total >= 1
        alone = [
            (await post(live.url, "/v1/completions", body | {"seed": seed})).json()
            for seed in (30, 31)
        ]
        texts = [c["text"] for c in replies["both"]["choices"]]
        assert texts == [a["choices"][0]["text"] for a in alone]
        assert all(c["finish_reason"] == "length" for c in replies["both"]["choices"])
        assert live.pool_is_idle()
