"""The ASGI app driven directly under a mock clock: Quart's RESPONSE_TIMEOUT, disconnects.

No sockets and no model: a fake executor whose every step takes 30 s of *mock*
time, so a three-minute stream runs in milliseconds and deterministically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from triollm.outcomes import EndCode, Refused
from triollm.plan import SampledToken, StepPlan, StepResult
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.server.app import ServedModel, create_app
from triollm.server.metrics import Metrics
from triollm.service import Service, ServiceConfig

STEP_SECONDS = 30.0


class SlowFake:
    def add(self, seq_id: int, prompt_ids: Sequence[int], params: Any) -> None:
        pass

    def remove(self, seq_id: int) -> None:
        pass

    def run(self, plan: StepPlan) -> StepResult:
        sampled = tuple(SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample)
        return StepResult(plan.step, sampled, plan.n_rows)

    async def run_step(self, plan: StepPlan) -> StepResult:
        await trio.sleep(STEP_SECONDS)  # mock time: a slow model
        return self.run(plan)


@pytest.fixture(autouse=True)
def worker_threads_run_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The app tokenizes (and decodes, and compiles grammars) in worker threads. On the
    autojump clock a task waiting for a thread counts as idle, so mock time jumps
    while the thread's real work runs: to the next deadline, and past every timeout
    in the test when the machine is slow (a 0.3 s tokenizer made the queue-budget
    test fail every time). Here the calls run inline, so mock time is the test's."""

    async def inline(fn: Any, *args: Any, limiter: Any = None, **kw: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)


class FakeTokenizer:
    vocab_size = 100

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        return [3] * len(text)

    def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        return [3, 4]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class Detok:
    def __init__(self, prompt: Sequence[int]) -> None:
        pass

    def push(self, token_id: int) -> str:
        return "x"

    def flush(self) -> str:
        return ""


def make_app(nursery: trio.Nursery, queue_wait_s: float = 1000.0) -> tuple[Any, Service, Metrics]:
    fake = SlowFake()
    metrics = Metrics("m")
    service = Service(
        Scheduler(SchedulerConfig(num_blocks=8, block_size=8, slots=1, context_tokens=64)),
        fake,
        detokenizer=Detok,
        config=ServiceConfig(queue_wait_s=queue_wait_s),
        step_runner=fake.run_step,
        observer=metrics,
    )
    served = ServedModel("m", FakeTokenizer(), 64, 0, eos_token_ids=frozenset({1}))  # type: ignore[arg-type]
    return create_app(service, served, metrics, drain_nursery=nursery), service, metrics


def scope(path: str = "/v1/completions") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "extensions": {},
    }


async def test_a_stream_longer_than_quart_response_timeout_is_not_cut(autojump_clock):
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 6, "stream": True}).encode()
    sent: list[dict[str, Any]] = []
    disconnect = trio.Event()

    async def receive() -> dict[str, Any]:
        if not sent and not getattr(receive, "done", False):
            receive.done = True  # type: ignore[attr-defined]
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            body_at.append(trio.current_time())

    body_at: list[float] = []  # when each body message left (mock time: exact)
    async with trio.open_nursery() as nursery:
        app, service, _ = make_app(nursery)
        await nursery.start(service.run)
        start = trio.current_time()
        await app(scope(), receive, send)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert elapsed >= 6 * STEP_SECONDS > 60  # longer than Quart's default RESPONSE_TIMEOUT
    assert sent[0]["status"] == 200
    stream = b"".join(m.get("body", b"") for m in sent[1:])
    assert stream.endswith(b"data: [DONE]\n\n")
    assert sent[-1]["more_body"] is False
    # One ASGI message per event, as it is made: 6 tokens -> 5 chunks + final + [DONE].
    assert sum(1 for m in sent[1:] if m.get("body")) == 7
    # ...and each leaves when its step ends, not with the last: the five token chunks
    # go at five different step times, the first within two steps of the request. A
    # writer that held the events to the end sends the same seven messages at once.
    assert len(set(body_at[:5])) == 5
    assert body_at[0] <= start + 2 * STEP_SECONDS < body_at[4]


async def test_a_disconnect_while_blocked_on_the_channel_cancels_at_once(autojump_clock):
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}).encode()
    sent: list[dict[str, Any]] = []
    disconnect = trio.Event()
    first_body = trio.Event()

    async def receive() -> dict[str, Any]:
        if not getattr(receive, "done", False):
            receive.done = True  # type: ignore[attr-defined]
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            first_body.set()

    async with trio.open_nursery() as nursery:
        app, service, metrics = make_app(nursery)
        await nursery.start(service.run)
        nursery.start_soon(app, scope(), receive, send)
        await first_body.wait()
        # The handler is now parked on its channel, waiting for the next 30 s step.
        left_at = trio.current_time()
        disconnect.set()
        await service.wait_until(lambda: service.live_requests == 0)
        assert trio.current_time() == left_at  # no step had to finish first
        s = service.scheduler.statistics()
        assert (s.blocks_free, s.running) == (s.blocks_total, 0)
        assert metrics.rejection_count(EndCode.CLIENT_CLOSED) == 1
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert sent[-1].get("more_body") is not False  # the response never completed


async def test_a_disconnect_while_queued_is_499_not_429(autojump_clock):

    def request(max_tokens: int) -> tuple[Any, Any, trio.Event]:
        body = json.dumps(
            {"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
        ).encode()
        gone = trio.Event()
        state = {"read": False}

        async def receive() -> dict[str, Any]:
            if not state["read"]:
                state["read"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            pass

        return receive, send, gone

    async with trio.open_nursery() as nursery:
        app, service, metrics = make_app(nursery)
        await nursery.start(service.run)
        r1, s1, gone1 = request(40)
        nursery.start_soon(app, scope(), r1, s1)
        await service.wait_until(lambda: service.scheduler.statistics().running == 1)
        r2, s2, gone2 = request(5)
        nursery.start_soon(app, scope(), r2, s2)
        await service.wait_until(lambda: service.queue.waiting == 1)
        gone2.set()
        await service.wait_until(lambda: metrics.rejection_count(EndCode.CLIENT_CLOSED) == 1)
        assert service.queue.waiting == 0
        assert metrics.rejection_count(Refused.QUEUE_TIMEOUT) == 0
        gone1.set()
        await service.wait_until(lambda: service.live_requests == 0)
        nursery.cancel_scope.cancel()
    assert math.isfinite(trio.current_time())


def test_the_app_cannot_be_built_without_the_nursery_its_drainers_run_in() -> None:
    """hypercorn 0.18 deadlocks closing a connection whose refused body nobody reads;
    Lifetime's drainers prevent it and must outlive the request. When the nursery was
    injected after construction, an app mounted any other way ran without them."""
    import inspect

    from triollm.server.lifetime import Lifetime

    for build in (create_app, Lifetime):
        param = inspect.signature(build).parameters["drain_nursery"]
        assert param.default is inspect.Parameter.empty, build
        assert "None" not in str(param.annotation), build


async def test_a_refused_body_is_drained_by_the_apps_own_nursery(autojump_clock):
    """A 404 answered before the body was read: the rest of the body is read to the
    disconnect by a task in the app's drain nursery, after the request has ended."""
    received: list[str] = []
    disconnect = trio.Event()

    async def receive() -> dict[str, Any]:
        if len(received) < 3:
            received.append("body")
            return {"type": "http.request", "body": b"x" * 10, "more_body": True}
        await disconnect.wait()
        received.append("disconnect")
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with trio.open_nursery() as drainers:
        app, _, _ = make_app(drainers)
        post = scope("/v1/nowhere")
        post["headers"] = [*post["headers"], (b"content-length", b"1000")]
        await app(post, receive, send)  # the request ends; its body is still coming
        assert sent[0]["status"] == 404
        assert (b"connection", b"close") in sent[0]["headers"]
        await trio.testing.wait_all_tasks_blocked()
        disconnect.set()  # the drainer, still alive, reads on to the disconnect
    assert received[-1] == "disconnect"


async def test_a_wait_past_the_budget_is_429_queue_timeout_through_the_app(autojump_clock):
    """The queue-wait budget on the live path: one slot, held by a long stream; a
    second request waits queue_wait_s of mock time and gets 429 queue_timeout with
    Retry-After (not 499: its client never left), and nothing stays behind."""
    sent: dict[str, list[dict[str, Any]]] = {"long": [], "late": []}

    def request(name: str, max_tokens: int) -> tuple[Any, Any]:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": max_tokens}).encode()
        state = {"read": False}

        async def receive() -> dict[str, Any]:
            if not state["read"]:
                state["read"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()  # the client never leaves
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            sent[name].append(message)

        return receive, send

    with trio.fail_after(10_000):  # mock time; a lost timeout fails instead of hanging
        async with trio.open_nursery() as nursery:
            app, service, metrics = make_app(nursery, queue_wait_s=7.0)
            await nursery.start(service.run)
            nursery.start_soon(app, scope(), *request("long", 40))  # 40 steps x 30 s
            await service.wait_until(lambda: service.scheduler.statistics().running == 1)
            asked = trio.current_time()
            await app(scope(), *request("late", 5))  # returns when it is answered
            assert trio.current_time() - asked == 7.0
            start = sent["late"][0]
            assert start["status"] == 429
            assert (b"retry-after", b"7") in [(k.lower(), v) for k, v in start["headers"]]
            error = json.loads(b"".join(m.get("body", b"") for m in sent["late"][1:]))["error"]
            assert error["code"] == "queue_timeout" and error["type"] == "rate_limit_error"
            assert metrics.rejection_count(Refused.QUEUE_TIMEOUT) == 1
            assert metrics.rejection_count(EndCode.CLIENT_CLOSED) == 0
            assert service.queue.waiting == 0 and service.scheduler.statistics().waiting == 0
            nursery.cancel_scope.cancel()
