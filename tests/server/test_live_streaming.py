"""Streaming, disconnects, overload and batching against a live server.

Generation is held still with a StepGate (the batch loop parks before a step until
the test allows it), and every wait is on the service's own state change events:
no sleeps, no wall-clock thresholds.
"""

from __future__ import annotations

import openai
import trio
from serverkit import (
    MODEL_ID,
    StepGate,
    live_server,
    raw_post,
    read_until,
    sse_payloads,
    unchunk,
)

from triollm.outcomes import EndCode, Refused

BODY = {"model": MODEL_ID, "prompt": "Hello there", "temperature": 0, "stream": True}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_the_first_chunk_arrives_while_generation_is_still_running(loaded):
    async with live_server(loaded) as live:
        gate = StepGate(live.service)
        sock = await raw_post(live.port, "/v1/completions", BODY | {"max_tokens": 40})
        gate.allow(2)  # prefill (first token) + one decode step, then the loop parks
        buf = bytearray()
        assert await read_until(sock, b"data: {", buf)
        await live.service.wait_until(lambda: gate.parked)
        # A chunk is in our hands, and the request is still generating (parked mid-way):
        # the server streams as it goes, it does not buffer the answer.
        assert live.service.live_requests == 1
        assert gate.steps == 2
        gate.open()
        assert await read_until(sock, b"\r\n0\r\n\r\n", buf)  # the end of the chunked body
        events = sse_payloads(unchunk(bytes(buf)))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        await sock.aclose()
        assert live.pool_is_idle()


async def test_a_client_that_hangs_up_mid_stream_frees_its_blocks_and_the_next_is_admitted(
    loaded,
):
    async with live_server(loaded, slots=1) as live:
        service, metrics = live.service, live.stack.metrics
        gate = StepGate(service)
        first = await raw_post(live.port, "/v1/completions", BODY | {"max_tokens": 60})
        await service.wait_until(lambda: gate.parked)
        c = client(live.url)
        results: list[str] = []

        async def second() -> None:
            r = await trio.to_thread.run_sync(
                lambda: c.completions.create(
                    model=MODEL_ID,
                    prompt="second",
                    max_tokens=5,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            results.append(r.choices[0].finish_reason)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await service.wait_until(lambda: service.queue.waiting == 1)
            gate.allow(3)
            buf = bytearray()
            assert await read_until(first, b"data: {", buf)
            await service.wait_until(lambda: gate.parked)
            held = service.scheduler.statistics().blocks_held
            assert held > 0 and service.queue.waiting == 1
            await first.aclose()  # hang up mid-stream, the handler blocked on its channel
            await service.wait_until(lambda: metrics.rejection_count(EndCode.CLIENT_CLOSED) == 1)
            # Its blocks went back and the queued request took the slot.
            await service.wait_until(lambda: service.queue.waiting == 0)
            assert service.scheduler.statistics().running == 1
            gate.open()
        assert results == ["length"]
        assert live.pool_is_idle()
        assert service.live_requests == 0


async def test_a_client_that_hangs_up_while_queued_is_499_and_leaves_nothing(loaded):
    async with live_server(loaded, slots=1) as live:
        service, metrics = live.service, live.stack.metrics
        gate = StepGate(service)
        first = await raw_post(live.port, "/v1/completions", BODY | {"max_tokens": 8})
        await service.wait_until(lambda: gate.parked)
        queued = await raw_post(live.port, "/v1/completions", BODY | {"max_tokens": 8})
        await service.wait_until(lambda: service.queue.waiting == 1)
        await queued.aclose()  # before the first byte of its response
        await service.wait_until(lambda: metrics.rejection_count(EndCode.CLIENT_CLOSED) == 1)
        assert service.queue.waiting == 0
        assert service.scheduler.statistics().waiting == 0
        gate.open()
        buf = bytearray()
        assert await read_until(first, b"data: [DONE]", buf)
        await first.aclose()
        # The next request is admitted and served normally.
        c = client(live.url)
        r = await trio.to_thread.run_sync(
            lambda: c.completions.create(
                model=MODEL_ID, prompt="next", max_tokens=3, extra_body={"ignore_eos": True}
            )
        )
        assert r.usage.completion_tokens == 3
        assert live.pool_is_idle()


async def test_overload_gets_clean_429s_at_once_and_every_admitted_request_completes(loaded):
    async with live_server(loaded, slots=1, queue_depth_per_slot=2, queue_wait_s=7) as live:
        service, metrics = live.service, live.stack.metrics
        gate = StepGate(service)  # no step runs until the test says so
        heads_send, heads_recv = trio.open_memory_channel[tuple[int, bytes]](16)
        done: list[int] = []

        async def client_task(i: int) -> None:
            sock = await raw_post(live.port, "/v1/completions", BODY | {"max_tokens": 4 + i})
            buf = bytearray()
            assert await read_until(sock, b"\r\n\r\n", buf)
            head = bytes(buf).split(b"\r\n\r\n")[0].lower()
            status = int(head.split(b" ", 2)[1])
            await heads_send.send((status, head))
            if status == 200:
                assert await read_until(sock, b"data: [DONE]", buf)
                done.append(i)
            await sock.aclose()

        async with trio.open_nursery() as nursery:
            for i in range(7):
                nursery.start_soon(client_task, i)
            # 1 running + 2 waiting; the other 4 are refused at once: five status lines
            # arrive before a single forward pass has run.
            early = [await heads_recv.receive() for _ in range(5)]
            assert gate.steps == 0
            assert sorted(status for status, _ in early) == [200, 429, 429, 429, 429]
            assert all(b"retry-after: 7" in head for status, head in early if status == 429)
            assert service.queue.waiting == 2
            assert metrics.rejection_count(Refused.QUEUE_FULL) == 4
            gate.open()
            late = [await heads_recv.receive() for _ in range(2)]
            assert [status for status, _ in late] == [200, 200]
        assert len(done) == 3
        await service.wait_until(lambda: service.live_requests == 0)
        assert live.pool_is_idle()


async def test_two_requests_share_forward_passes_and_greedy_output_is_unchanged(loaded):
    async with live_server(loaded, slots=2) as live:
        service = live.service
        c = client(live.url)

        def complete(prompt: str) -> str:
            r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0)
            return r.choices[0].text

        alone = [
            await trio.to_thread.run_sync(complete, "The cat"),
            await trio.to_thread.run_sync(complete, "Once upon a time, far away"),
        ]
        gate = StepGate(service)
        together: dict[str, str] = {}

        async def run(prompt: str) -> None:
            together[prompt] = await trio.to_thread.run_sync(complete, prompt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "The cat")
            nursery.start_soon(run, "Once upon a time, far away")
            await service.wait_until(lambda: service.scheduler.statistics().running == 2)
            gate.open()
        assert [together["The cat"], together["Once upon a time, far away"]] == alone
        assert service.recorder.max_width >= 2
        wide = [r for r in service.recorder.records if r.width >= 2]
        assert len(set(wide[0].seq_ids)) == 2
        assert live.pool_is_idle()


async def test_preempt_policy_recomputes_and_output_is_unchanged(loaded):
    # 6 blocks of 16 positions: two 60-token answers cannot both grow to the end,
    # so the later one is preempted (its blocks freed) and recomputed.
    async with live_server(
        loaded, slots=2, policy="preempt", block_size=16, num_blocks=6, context_tokens=96
    ) as live:
        service = live.service
        c = client(live.url)

        def complete(prompt: str) -> str:
            r = c.completions.create(
                model=MODEL_ID,
                prompt=prompt,
                max_tokens=60,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        alone = [await trio.to_thread.run_sync(complete, p) for p in ("The cat", "A dog")]
        together: dict[str, str] = {}

        async def run(prompt: str) -> None:
            together[prompt] = await trio.to_thread.run_sync(complete, prompt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "The cat")
            nursery.start_soon(run, "A dog")
        assert service.scheduler.statistics().preemptions_total >= 1
        assert [together["The cat"], together["A dog"]] == alone
        assert live.pool_is_idle()
