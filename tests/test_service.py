"""The Service's batch loop with a fake executor: no model, no threads, no wall clock.

The fake "model" produces scripted tokens; its detokenizer maps a token id to one
letter. Steps run on the event loop through a gate the test opens one step at a
time, so every interleaving below is exact (one test runs the server's own worker
thread runner, and asserts only an order the event loop itself decides).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from triollm.admission import QueueClosed, QueueFull
from triollm.batch import BadChunks
from triollm.events import StepKind
from triollm.model.sampling import SamplingParams
from triollm.outcomes import EndCode, Unfinished
from triollm.plan import FinishReason, SampledToken, SequenceFailure, StepPlan, StepResult
from triollm.request import answer_budget
from triollm.scheduler import Scheduler, SchedulerConfig, SeqState
from triollm.service import Completed, Failed, Lifecycle, Service, ServiceConfig
from triollm.spec import GenerationSpec, SequenceSpec

EOS = 1


def letter(token: int) -> str:
    return chr(ord("a") + (token - 2) % 26)


def tok(ch: str) -> int:
    return ord(ch) - ord("a") + 2


class LetterDetok:
    def __init__(self, prompt_ids: Sequence[int]) -> None:
        pass

    def push(self, token_id: int) -> str:
        return letter(token_id)

    def flush(self) -> str:
        return ""


class FakeExecutor:
    """Scripted tokens per sequence (default: a b c ... forever). With ``gated``,
    each step waits for the test to call ``release()``."""

    def __init__(self, gated: bool = False) -> None:
        self.scripts: dict[int, list[int]] = {}
        self.members: set[int] = set()
        self.removed: list[int] = []
        self.steps: list[StepPlan] = []
        self.gated = gated
        self._gate_send, self._gate_recv = trio.open_memory_channel[None](math.inf)
        self.inflight: StepPlan | None = None
        self.fail_next = False
        self.refuse: set[int] = set()  # seq_ids whose chunks this executor refuses by name
        self.grammar_fails: set[int] = set()  # seq_ids whose grammar matcher fails when sampled

    def add(self, seq_id: int, spec: GenerationSpec, choice: int = 0) -> None:
        assert self.inflight is None, "membership changed while a step ran"
        self.members.add(seq_id)

    def remove(self, seq_id: int) -> None:
        assert self.inflight is None, "membership changed while a step ran"
        self.members.discard(seq_id)
        self.removed.append(seq_id)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate_send.send_nowait(None)

    def run(self, plan: StepPlan) -> StepResult:
        sampled = []
        failed = []
        for chunk in plan.chunks:
            assert chunk.seq_id in self.members, f"seq {chunk.seq_id} planned but not added"
            if chunk.sample and chunk.seq_id in self.grammar_fails:
                failed.append(SequenceFailure(chunk.seq_id, "the grammar matcher failed: limit"))
            elif chunk.sample:
                script = self.scripts.get(chunk.seq_id)
                n = sum(
                    1 for p in self.steps for c in p.chunks if c.seq_id == chunk.seq_id and c.sample
                )
                token = script[n] if script else tok("abcdefghij"[n % 10])
                sampled.append(SampledToken(chunk.seq_id, token))
        self.steps.append(plan)
        return StepResult(plan.step, tuple(sampled), plan.n_rows, failed=tuple(failed))

    async def run_step(self, plan: StepPlan) -> StepResult:
        self.inflight = plan
        try:
            if self.gated:
                await self._gate_recv.receive()
            else:
                await trio.lowlevel.checkpoint()
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("kernel exploded")
            bad = {c.seq_id for c in plan.chunks} & self.refuse
            if bad:
                raise BadChunks(sorted(bad), f"cannot run: {sorted(bad)}")
            return self.run(plan)
        finally:
            self.inflight = None


class Counter:
    def __init__(self) -> None:
        self.rejections: dict[Unfinished, int] = {}
        self.finishes: dict[FinishReason, int] = {}
        self.tokens = 0
        self.admissions: list[tuple[int, int]] = []  # (prompt tokens, choices) per request

    def admitted(self, prompt_tokens: int, queue_seconds: float, choices: int = 1) -> None:
        self.admissions.append((prompt_tokens, choices))

    def token(self, first: bool, seconds_since_previous: float) -> None:
        self.tokens += 1

    def finished(self, reason: FinishReason, e2e_seconds: float) -> None:
        self.finishes[reason] = self.finishes.get(reason, 0) + 1

    def ended_early(self, reason: Unfinished) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def step(self, rows: int, width: int, kind: StepKind, seconds: float) -> None:
        pass


def make_service(
    *, slots: int = 2, buffer: int = 8, gated: bool = False, num_blocks: int = 16, depth: int = 2
) -> tuple[Service, FakeExecutor, Counter]:
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=4,
            slots=slots,
            chunk_tokens=8,
            step_rows=16,
            context_tokens=32,
        )
    )
    ex = FakeExecutor(gated=gated)
    counter = Counter()
    service = Service(
        sched,
        ex,
        detokenizer=LetterDetok,
        config=ServiceConfig(
            queue_depth_per_slot=depth, queue_wait_s=30.0, stream_buffer_steps=buffer
        ),
        observer=counter,
        step_runner=ex.run_step,
    )
    return service, ex, counter


def gen(
    prompt: Sequence[int],
    *,
    max_tokens: int | None = None,
    ignore_eos: bool = False,
    stop: Sequence[str] = (),
    **fields: Any,
) -> GenerationSpec:
    """A request as ``request.Preparer`` makes one: EOS among the ids it ends on unless
    the client ignores it (the fake executor's sampling parameters are never read)."""
    ends = frozenset() if ignore_eos else frozenset({EOS})
    return GenerationSpec(prompt, SamplingParams(), max_tokens, ends, stop=stop, **fields)


def unset_budget(service: Service, prompt: Sequence[int], n: int = 1) -> int | None:
    """The max_tokens ``request.Preparer`` gives a chat request that leaves it out: the
    one rule (``answer_budget``) over the room this service's scheduler has."""
    room = service.scheduler.room(SequenceSpec(prompt, n=n))
    return answer_budget(None, room, configured=service.config.max_tokens_default, api_default=None)


async def read_all(stream) -> str:
    text = ""
    async for delta in stream:
        text += delta.text
    outcome = stream.outcome
    if isinstance(outcome, Completed):
        text += outcome.final.text
    return text


def pool_is_full(service: Service) -> bool:
    s = service.scheduler.statistics()
    return s.blocks_free == s.blocks_total and s.running == 0


# ----------------------------------------------------------------------------- streaming


async def test_a_request_streams_its_tokens_and_finishes_with_length(autojump_clock):
    service, ex, counter = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        stream = await service.submit(gen([5, 6, 7], max_tokens=4))
        deltas = [d.text async for d in stream]
        outcome = stream.outcome
        assert isinstance(outcome, Completed)
        assert (outcome.finish_reason, outcome.completion_tokens) == (FinishReason.LENGTH, 4)
        assert "".join(deltas) + outcome.final.text == "abcd"
        assert len(deltas) == 3  # one delta per step; the last token rides on the outcome
        assert pool_is_full(service)
        await trio.testing.wait_all_tasks_blocked()
        assert ex.removed == [stream.seq_id]  # taken out of the batch at the next safe point
        nursery.cancel_scope.cancel()
    assert counter.finishes == {FinishReason.LENGTH: 1}


async def test_a_stop_string_is_never_emitted_and_finishes_the_sequence(autojump_clock):
    service, ex, _ = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.scripts[0] = [tok(c) for c in "abxyzcdefg"]
        stream = await service.submit(gen([5], max_tokens=10, stop=["xyz"]))
        assert stream.seq_id == 0
        text = await read_all(stream)
        assert text == "ab"
        assert stream.outcome.finish_reason is FinishReason.STOP
        assert stream.outcome.completion_tokens == 5  # a b x y z, then finished early
        assert service.scheduler.state(0) is SeqState.FINISHED
        assert pool_is_full(service)
        nursery.cancel_scope.cancel()


async def test_eos_finishes_with_stop_and_is_not_text(autojump_clock):
    service, ex, _ = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.scripts[0] = [tok("h"), tok("i"), EOS, tok("z")]
        stream = await service.submit(gen([5], max_tokens=10))
        assert await read_all(stream) == "hi"
        outcome = stream.outcome
        assert (outcome.finish_reason, outcome.completion_tokens) == (FinishReason.STOP, 3)
        nursery.cancel_scope.cancel()


async def test_ignore_eos_keeps_generating(autojump_clock):
    service, ex, _ = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.scripts[0] = [tok("h"), EOS, tok("z")]
        stream = await service.submit(gen([5], max_tokens=3, ignore_eos=True))
        text = await read_all(stream)
        assert stream.outcome.finish_reason is FinishReason.LENGTH
        assert text.endswith("z")
        nursery.cancel_scope.cancel()


async def test_two_requests_share_forward_passes(autojump_clock):
    service, _ex, _ = make_service(slots=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        results: dict[int, str] = {}

        async def client(prompt: list[int]) -> None:
            stream = await service.submit(gen(prompt, max_tokens=5))
            results[stream.seq_id] = await read_all(stream)

        # Not service.wait_until: `results` is the clients' state, not the service's,
        # and nothing in the service changes after their last read (a lost wake-up).
        async with trio.open_nursery() as clients:
            clients.start_soon(client, [5, 6])
            clients.start_soon(client, [7, 8, 9])
        assert service.recorder.max_width == 2
        assert service.recorder.shared(0, 1)
        assert results == {0: "abcde", 1: "abcde"}
        nursery.cancel_scope.cancel()


async def test_the_idle_loop_sleeps_on_an_event_not_a_timer(autojump_clock):
    service, ex, _ = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await trio.testing.wait_all_tasks_blocked()
        autojump_clock.jump(3600)
        await trio.testing.wait_all_tasks_blocked()
        assert ex.steps == []  # an hour of idle: not a single step, not a single wake
        stream = await service.submit(gen([5], max_tokens=1))
        assert await read_all(stream) == "a"
        nursery.cancel_scope.cancel()


def _thread_runner_service(monkeypatch: Any) -> tuple[Service, list[object]]:
    """A Service on the real thread runner (the server's), and the list of the step
    functions it has handed to a worker thread so far, in order."""
    started: list[object] = []
    real_start = trio.lowlevel.start_thread_soon

    def recording_start(fn: Any, deliver: Any, name: str | None = None) -> None:
        started.append(fn)
        real_start(fn, deliver, name)

    monkeypatch.setattr(trio.lowlevel, "start_thread_soon", recording_start)
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=16, block_size=4, slots=2, chunk_tokens=8, step_rows=16, context_tokens=32
        )
    )
    return Service(sched, FakeExecutor(), detokenizer=LetterDetok), started


async def test_the_next_step_computes_while_the_reader_takes_the_last_steps_token(monkeypatch):
    """The thread runner (the server's) starts step N+1's thread before the loop
    yields after dispatching step N, so the handler that dispatch woke writes its event
    while N+1 computes, not in front of it (a fixed cost per token on a small model).
    The one test here with a real worker thread: the order asserted is the event
    loop's own (the reader cannot run before the loop yields), not a race."""
    service, started = _thread_runner_service(monkeypatch)
    with trio.fail_after(60):  # real time: a lost wake-up shows as an error, not a hang
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            stream = await service.submit(gen([5], max_tokens=4))
            seen = []
            async for delta in stream:  # tokens 1-3 (the 4th rides on the outcome)
                seen.append(delta.text)
                # Token k came from step k; step k + 1's thread is already running.
                assert len(started) >= len(seen) + 1, (seen, len(started))
            assert "".join(seen) + stream.outcome.final.text == "abcd"
            nursery.cancel_scope.cancel()


async def test_a_cancelled_loop_starts_no_step_after_the_one_in_flight(monkeypatch):
    """The thread runner waits for its step even when cancelled (the thread writes the
    KV pool), and it does not yield before starting one; so it must notice the
    cancellation itself, or a shutting-down loop would start step after step."""
    service, started = _thread_runner_service(monkeypatch)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            stream = await service.submit(gen([5], max_tokens=20))
            await stream.__anext__()  # token 1 arrived: step 2 is in flight
            at_cancel = len(started)
            nursery.cancel_scope.cancel()
    assert len(started) == at_cancel  # the step in flight ended; no new one began


# ----------------------------------------------------------------------------- backpressure


async def test_a_slow_reader_is_cut_off_and_its_neighbour_completes(autojump_clock):
    service, _ex, counter = make_service(slots=2, buffer=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        slow = await service.submit(gen([5], max_tokens=20))
        fast_text: list[str] = []
        fast_done = trio.Event()

        async def fast() -> None:
            stream = await service.submit(gen([6], max_tokens=12))
            fast_text.append(await read_all(stream))
            fast_done.set()

        nursery.start_soon(fast)
        # The slow reader never reads: after 2 buffered steps the 3rd delta would block.
        await service.wait_until(lambda: slow.outcome is not None)
        assert isinstance(slow.outcome, Failed)
        assert slow.outcome.code is EndCode.TOO_SLOW
        assert slow.outcome.completion_tokens == 3
        assert service.scheduler.state(slow.seq_id) is SeqState.CANCELLED
        # What was buffered is still readable, then the stream ends.
        assert [d.text async for d in slow] == ["a", "b"]
        await fast_done.wait()
        assert fast_text == ["abcdefghij" + "ab"]
        assert pool_is_full(service)
        assert counter.rejections == {EndCode.TOO_SLOW: 1}
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- cancellation


async def test_a_client_leaving_mid_stream_returns_blocks_and_admits_the_next(autojump_clock):
    service, ex, counter = make_service(slots=1, gated=True, num_blocks=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        first = await service.submit(gen([5, 6], max_tokens=6))  # 8 positions: 2 blocks
        ex.release(2)
        assert [await first.__anext__() for _ in range(2)][1].text == "b"
        queued: list[Any] = []

        async def second() -> None:
            queued.append(await service.submit(gen([7], max_tokens=2)))

        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert queued == [] and service.queue.waiting == 1
        assert first.close() is True  # the handler's finally: the client left
        # Blocks are back at once (not at the next step), and the driver admitted the next.
        await trio.testing.wait_all_tasks_blocked()
        assert service.scheduler.state(first.seq_id) is SeqState.CANCELLED
        assert len(queued) == 1
        assert counter.rejections == {EndCode.CLIENT_CLOSED: 1}
        ex.release(10)
        assert await read_all(queued[0]) == "ab"
        assert first.close() is False  # idempotent: already ended
        nursery.cancel_scope.cancel()


async def test_a_cancel_during_a_step_waits_for_the_safe_point_to_leave_the_batch(autojump_clock):
    service, ex, _ = make_service(gated=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        stream = await service.submit(gen([5], max_tokens=8))
        await trio.testing.wait_all_tasks_blocked()
        assert ex.inflight is not None  # the first step is running
        stream.close()
        assert pool_is_full(service)  # blocks back even though the step still runs
        assert ex.removed == []  # ...but the executor is not touched mid-step
        ex.release()
        await trio.testing.wait_all_tasks_blocked()
        assert ex.removed == [stream.seq_id]  # commit ignored its token; removed after
        assert ex.inflight is None and len(ex.steps) == 1
        nursery.cancel_scope.cancel()


async def test_a_client_leaving_while_queued_leaves_nothing_behind(autojump_clock):
    service, _ex, _counter = make_service(slots=1, gated=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        holder = await service.submit(gen([5], max_tokens=8))
        with trio.move_on_after(5) as client:
            await service.submit(gen([6], max_tokens=2))
        assert client.cancelled_caught
        assert service.queue.waiting == 0
        assert service.live_requests == 1
        holder.close()
        nursery.cancel_scope.cancel()


async def test_overload_refuses_the_excess_at_once(autojump_clock):
    service, _ex, _ = make_service(slots=1, depth=2, gated=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await service.submit(gen([5], max_tokens=2))
        for _ in range(2):
            nursery.start_soon(lambda: service.submit(gen([5], max_tokens=2)))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull):
            await service.submit(gen([5], max_tokens=2))
        nursery.cancel_scope.cancel()


async def test_a_failed_step_fails_only_its_requests_and_the_loop_goes_on(autojump_clock):
    service, ex, counter = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.fail_next = True
        stream = await service.submit(gen([5], max_tokens=3))
        assert await read_all(stream) == ""
        assert isinstance(stream.outcome, Failed) and stream.outcome.code is EndCode.INTERNAL
        assert counter.rejections == {EndCode.INTERNAL: 1}  # the server's fault is counted
        assert pool_is_full(service)
        again = await service.submit(gen([5], max_tokens=3))
        assert await read_all(again) == "abc"
        nursery.cancel_scope.cancel()


async def test_a_refused_chunk_fails_only_its_sequence_and_its_neighbour_runs_on(autojump_clock):
    service, ex, _ = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        good = await service.submit(gen([5], max_tokens=6))
        bad_id = good.seq_id + 1
        ex.refuse.add(bad_id)
        bad = await service.submit(gen([6], max_tokens=6))
        assert bad.seq_id == bad_id
        assert await read_all(bad) == ""
        assert isinstance(bad.outcome, Failed) and bad.outcome.code is EndCode.INTERNAL
        assert await read_all(good) == "abcdef"
        assert (
            isinstance(good.outcome, Completed)
            and good.outcome.finish_reason is FinishReason.LENGTH
        )
        await service.wait_until(lambda: pool_is_full(service))
        nursery.cancel_scope.cancel()


async def test_unset_max_tokens_fits_a_pool_smaller_than_the_context(autojump_clock):
    # context 32 positions, pool 6 blocks x 4 = 24: "the rest of the context" would
    # never fit; the rest of the pool does.
    service, _, _ = make_service(num_blocks=6)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        stream = await service.submit(gen([5, 5, 5], max_tokens=unset_budget(service, [5] * 3)))
        await read_all(stream)
        assert isinstance(stream.outcome, Completed)
        assert stream.outcome.finish_reason is FinishReason.LENGTH
        assert stream.outcome.completion_tokens == 24 - 3
        nursery.cancel_scope.cancel()


async def test_a_failure_outside_the_step_ends_every_stream_and_the_service_goes_unready(
    autojump_clock,
):
    class Exploding(Counter):
        def token(self, first: bool, seconds_since_previous: float) -> None:
            super().token(first, seconds_since_previous)
            if self.tokens == 3:
                raise RuntimeError("observer bug")

    service, _, _ = make_service()
    service.observer = Exploding()
    service.state = Lifecycle.READY
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        a = await service.submit(gen([5], max_tokens=8))
        b = await service.submit(gen([6], max_tokens=8))
        await read_all(a)
        await read_all(b)
        for stream in (a, b):
            assert isinstance(stream.outcome, Failed) and stream.outcome.code is EndCode.INTERNAL
            assert "observer bug" in stream.outcome.message
        assert pool_is_full(service)
        assert not service.ready and service.failed is not None
        with pytest.raises(QueueClosed, match="batch loop failed"):
            await service.submit(gen([5], max_tokens=2))
        nursery.cancel_scope.cancel()


async def test_shutdown_refuses_new_work_and_lets_running_streams_finish(autojump_clock):
    service, _ex, _ = make_service(slots=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        running = await service.submit(gen([5], max_tokens=3))
        service.begin_shutdown()
        assert await read_all(running) == "abc"
        from triollm.admission import QueueClosed

        with pytest.raises(QueueClosed):
            await service.submit(gen([5], max_tokens=3))
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- preemption


async def test_a_preempted_sequence_readmitted_by_the_driver_wakes_the_parked_loop(
    autojump_clock,
):
    """Waiters [H, P]: P overtook H, then was preempted; A finishes and the loop parks
    (P cannot come back in a plan while H is the head). H's client leaves and the
    driver admits P. P is not a waiter of the queue (its request never stopped
    streaming), so only a wake for re-admissions gets a step to run for it."""
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=4,
            block_size=4,
            slots=2,
            chunk_tokens=16,
            step_rows=24,
            context_tokens=32,
            policy="preempt",
        )
    )
    ex = FakeExecutor(gated=True)
    service = Service(sched, ex, detokenizer=LetterDetok, step_runner=ex.run_step)

    async def manual_driver(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # the test calls service.queue.drive() itself, at exact points
        await trio.sleep_forever()

    service.queue.run = manual_driver  # type: ignore[method-assign]
    outcomes: dict[str, object] = {}
    p_done = trio.Event()  # the client's own record, not a service state: its own event

    async def client(name: str, prompt: list[int], max_tokens: int) -> None:
        stream = await service.submit(gen(prompt, max_tokens=max_tokens))
        try:
            await read_all(stream)
        finally:
            stream.close()
        outcomes[name] = stream.outcome
        if name == "P":
            p_done.set()

    with trio.fail_after(600):  # mock time: a stall shows as TooSlowError, not a hang
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            nursery.start_soon(client, "A", [2] * 4, 8)
            await trio.testing.wait_all_tasks_blocked()
            service.queue.drive()  # A: admitted
            h_scope = trio.CancelScope()

            async def h_client() -> None:
                with h_scope:
                    await client("H", [3] * 12, 1)

            nursery.start_soon(h_client)
            await trio.testing.wait_all_tasks_blocked()
            assert service.queue.drive() == ()  # H does not fit beside A
            nursery.start_soon(client, "P", [4] * 4, 8)
            await trio.testing.wait_all_tasks_blocked()
            (p,) = service.queue.drive()  # P fits: it overtakes H
            while "A" not in outcomes:  # A and P grow; P (the latest) is preempted
                ex.release()
                await trio.testing.wait_all_tasks_blocked()
            assert sched.state(p) is SeqState.WAITING and sched.statistics().running == 0
            assert ex.inflight is None  # the loop has parked on an empty plan
            h_scope.cancel()  # H's client leaves before the driver's next pass
            await trio.testing.wait_all_tasks_blocked()
            assert service.queue.drive() == (p,)  # the driver re-admits P
            ex.release(32)
            await p_done.wait()
            assert isinstance(outcomes["P"], Completed)
            assert outcomes["P"].completion_tokens == 8
            nursery.cancel_scope.cancel()


async def test_a_failing_grammar_ends_its_request_alone_with_an_error(autojump_clock):
    service, ex, counter = make_service()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        bad = await service.submit(gen([5], max_tokens=4))
        good = await service.submit(gen([6], max_tokens=4))
        ex.grammar_fails.add(bad.seq_id)
        assert await read_all(good) == "abcd"
        await read_all(bad)
        assert isinstance(bad.outcome, Failed) and bad.outcome.code is EndCode.GRAMMAR_FAILED
        assert "grammar" in bad.outcome.message
        assert isinstance(good.outcome, Completed)
        assert pool_is_full(service) and service.failed is None
        nursery.cancel_scope.cancel()
    assert counter.rejections == {EndCode.GRAMMAR_FAILED: 1}
