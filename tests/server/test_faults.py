"""Faults injected inside the live server: each ends exactly the requests it touched,
with a clear error event; the server keeps serving and no KV block leaks.

- the forward pass raises once: the requests in that step end (``internal``, the
  message says the step failed); a request queued behind them runs normally;
- one sequence's sampler raises once: the same (sampling is part of the step);
- one request's detokenizer raises: that request alone ends; its neighbour in the
  very same steps completes with its correct greedy text.
"""

from __future__ import annotations

from typing import Any

import httpx
import trio
from serverkit import MODEL_ID, StepGate, live_server, raw_post, read_until, sse_payloads, unchunk

from triollm.outcomes import EndCode

BODY = {
    "model": MODEL_ID,
    "max_tokens": 6,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


async def stream(port: int, prompt: str) -> list[Any]:
    s = await raw_post(port, "/v1/completions", BODY | {"prompt": prompt})
    buf = bytearray()
    with trio.fail_after(60):  # a hang guard
        assert await read_until(s, b"\r\n0\r\n\r\n", buf)
    await s.aclose()
    return sse_payloads(unchunk(bytes(buf)))


def text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")
    )


async def greedy(url: str, prompt: str) -> str:
    body = BODY | {"prompt": prompt, "stream": False}
    r = await trio.to_thread.run_sync(
        lambda: httpx.post(url + "/v1/completions", json=body, timeout=60)
    )
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def assert_internal_error(events: list[Any], words: str) -> None:
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "internal" and err["type"] == "server_error"
    assert words in err["message"]


async def test_a_forward_pass_that_raises_ends_its_steps_requests_and_the_server_goes_on(loaded):
    async with live_server(loaded, slots=1) as live:
        service = live.service
        batch = service.executor
        real = batch.model.forward
        calls = {"n": 0}

        def forward(chunks: Any, kv: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:  # the third step of the first request
                raise RuntimeError("injected forward-pass fault")
            return real(chunks, kv)

        batch.model.forward = forward
        try:
            gate = StepGate(service)
            results: dict[str, list[Any]] = {}

            async def run(prompt: str) -> None:
                results[prompt] = await stream(live.port, prompt)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "first")
                await service.wait_until(lambda: gate.parked)
                nursery.start_soon(run, "queued")  # one slot: it waits behind "first"
                await service.wait_until(lambda: service.queue.waiting == 1)
                gate.open()
        finally:
            batch.model.forward = real
        assert_internal_error(results["first"], "injected forward-pass fault")
        assert results["queued"][-2]["choices"][0]["finish_reason"] == "length"
        assert text(results["queued"]) == await greedy(live.url, "queued")
        assert live.pool_is_idle() and service.failed is None


async def test_a_sampler_that_raises_once_ends_its_steps_requests_only(loaded):
    async with live_server(loaded, slots=2) as live:
        service = live.service
        batch = service.executor
        gate = StepGate(service)
        results: dict[str, list[Any]] = {}

        async def run(prompt: str) -> None:
            results[prompt] = await stream(live.port, prompt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "sampled")
            await service.wait_until(lambda: gate.parked)
            [seq_id] = list(batch._samplers)
            sampler = batch._samplers[seq_id]
            real = sampler.sample

            def sample(row: Any) -> Any:
                sampler.sample = real  # once
                raise FloatingPointError("injected sampler fault")

            sampler.sample = sample
            gate.open()
        assert_internal_error(results["sampled"], "injected sampler fault")
        after = await stream(live.port, "after")
        assert after[-2]["choices"][0]["finish_reason"] == "length"
        assert live.pool_is_idle() and service.failed is None


async def test_a_detokenizer_that_raises_ends_that_request_alone(loaded):
    async with live_server(loaded, slots=2) as live:
        service = live.service
        expected = await greedy(live.url, "neighbour")
        make = service.output._detokenizer
        poison = list(loaded.tokenizer.encode("poisoned"))

        class Exploding:
            def __init__(self, inner: Any) -> None:
                self.inner, self.n = inner, 0

            def push(self, token_id: int) -> str:
                self.n += 1
                if self.n == 3:
                    raise UnicodeError("injected detokenizer fault")
                return self.inner.push(token_id)

            def flush(self) -> str:
                return self.inner.flush()

        def detokenizer(prompt_ids: Any) -> Any:
            inner = make(prompt_ids)
            return Exploding(inner) if list(prompt_ids) == poison else inner

        service.output._detokenizer = detokenizer
        gate = StepGate(service)
        results: dict[str, list[Any]] = {}

        async def run(prompt: str) -> None:
            results[prompt] = await stream(live.port, prompt)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "poisoned")
            nursery.start_soon(run, "neighbour")
            await service.wait_until(
                lambda: gate.parked and service.scheduler.statistics().running == 2
            )
            gate.open()
        assert_internal_error(results["poisoned"], "injected detokenizer fault")
        # The neighbour shared its steps and lost nothing.
        assert results["neighbour"][-2]["choices"][0]["finish_reason"] == "length"
        assert text(results["neighbour"]) == expected
        # ...and it did share them: both ran in the steps before the fault.
        (seq_a, code_a), (seq_b, code_b) = list(service.outcomes)[-2:]
        assert {str(code_a), str(code_b)} >= {str(EndCode.INTERNAL)}
        assert service.recorder.shared(seq_a, seq_b)
        assert live.pool_is_idle() and service.failed is None and service.ready
