"""The n choices of one request in the Service: one group in the scheduler, one channel
to the handler, each choice its own sampler, text and end (the fake executor of
test_service.py: no model, no threads, no wall clock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from test_service import gen, make_service, pool_is_full, tok, unset_budget
from triollm.admission import QueueFull
from triollm.events import Completed, Delta, Ended, Failed
from triollm.outcomes import EndCode
from triollm.output import RequestStream
from triollm.plan import FinishReason
from triollm.scheduler import Infeasible, SeqState
from triollm.spec import SequenceSpec


async def read_choices(stream: RequestStream) -> tuple[dict[int, str], list[object]]:
    """Each choice's text (its deltas, then its final delta), and the events in order."""
    texts: dict[int, str] = {}
    events: list[object] = []
    async for event in stream.events():
        events.append(event)
        if isinstance(event, Delta):
            texts[event.index] = texts.get(event.index, "") + event.text
        elif isinstance(event.outcome, Completed):
            final = event.outcome.final
            assert final.index == event.index
            texts[event.index] = texts.get(event.index, "") + final.text
    return texts, events


async def test_each_choice_streams_its_own_text_on_the_one_channel_and_ends_on_its_own(
    autojump_clock,
):
    service, ex, counter = make_service(slots=3, num_blocks=16)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.scripts.update({0: [tok(c) for c in "abc"], 1: [tok(c) for c in "xyz"]})
        ex.scripts[2] = [tok("p"), 1]  # EOS: the third choice stops first
        stream = await service.submit(gen([5, 6, 7], n=3, max_tokens=3))
        assert stream.n == 3 and stream.seq_ids == (0, 1, 2)
        texts, events = await read_choices(stream)
        assert texts == {0: "abc", 1: "xyz", 2: "p"}
        ends = [e for e in events if isinstance(e, Ended)]
        assert [e.index for e in ends] == [2, 0, 1]  # as they happened: EOS, then LENGTH
        for end in ends:  # each after its choice's last delta
            last = max(i for i, e in enumerate(events) if getattr(e, "index", -1) == end.index)
            assert events[last] is end
        reasons = [o.finish_reason for o in stream.outcomes]  # type: ignore[union-attr]
        assert reasons == [FinishReason.LENGTH, FinishReason.LENGTH, FinishReason.STOP]
        assert pool_is_full(service)
        nursery.cancel_scope.cancel()
    # Each choice is a finished sequence in the metrics.
    assert counter.finishes == {FinishReason.LENGTH: 2, FinishReason.STOP: 1}


async def test_the_prompt_is_counted_once_and_its_blocks_are_held_once(autojump_clock):
    service, ex, counter = make_service(slots=3, num_blocks=16, gated=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        prompt = list(range(5, 15))  # 10 tokens: two full blocks of 4 shared, then its own
        stream = await service.submit(gen(prompt, n=3, max_tokens=4))
        whole = 4  # (10 + 4) positions in blocks of 4
        assert service.scheduler.statistics().blocks_held == whole + 2 * (whole - 2)
        assert counter.admissions == [(10, 3)]  # the prompt once, for three choices
        ex.release(20)
        await read_choices(stream)
        nursery.cancel_scope.cancel()


async def test_closing_the_request_cancels_every_choice_and_frees_their_blocks_at_once(
    autojump_clock,
):
    service, ex, counter = make_service(slots=3, num_blocks=16, gated=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        stream = await service.submit(gen([5, 6, 7], n=3, max_tokens=8))
        ex.release(2)
        await stream.__anext__()
        assert service.scheduler.statistics().running == 3
        assert stream.close() is True  # the handler's finally: the client left
        assert pool_is_full(service)  # before any further step
        assert all(service.scheduler.state(q) is SeqState.CANCELLED for q in stream.seq_ids)
        assert all(isinstance(o, Failed) for o in stream.outcomes)
        assert stream.close() is False
        nursery.cancel_scope.cancel()
    assert counter.rejections == {EndCode.CLIENT_CLOSED: 3}


async def test_a_choice_whose_grammar_fails_ends_alone_and_the_others_complete(autojump_clock):
    service, ex, _ = make_service(slots=3, num_blocks=16)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.grammar_fails.add(1)
        stream = await service.submit(gen([5], n=3, max_tokens=3))
        texts, _ = await read_choices(stream)
        first, second, third = stream.outcomes
        assert isinstance(second, Failed) and second.code is EndCode.GRAMMAR_FAILED
        assert isinstance(first, Completed) and isinstance(third, Completed)
        assert texts == {0: "abc", 2: "abc"}
        assert stream.outcome is second  # the request's: the choice that failed
        assert pool_is_full(service)
        nursery.cancel_scope.cancel()


async def test_a_client_too_slow_for_its_choices_is_cut_on_every_choice(autojump_clock):
    service, _ex, counter = make_service(slots=2, buffer=2, num_blocks=16)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        stream = await service.submit(gen([5], n=2, max_tokens=20))
        # Nobody reads: the buffer holds 2 steps of both choices (4 deltas), then it is full.
        await service.wait_until(lambda: None not in stream.outcomes)
        assert all(isinstance(o, Failed) and o.code is EndCode.TOO_SLOW for o in stream.outcomes)
        texts, events = await read_choices(stream)
        assert texts == {0: "ab", 1: "ab"}  # what was buffered, then every choice's end
        assert [e.index for e in events if isinstance(e, Ended)] == [0, 1]
        assert pool_is_full(service)
        nursery.cancel_scope.cancel()
    assert counter.rejections == {EndCode.TOO_SLOW: 2}


async def test_the_choices_take_n_places_in_the_queue(autojump_clock):
    service, _ex, _ = make_service(slots=2, depth=1, gated=True)  # 2 places
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        for prompt in ([5], [6]):  # both slots held
            await service.submit(gen(prompt, max_tokens=2))
        single = trio.CancelScope()

        async def one_waiter() -> None:
            with single:
                await service.submit(gen([7], max_tokens=2))

        nursery.start_soon(one_waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert service.queue.waiting == 1  # one place of 2 is left: not enough for two
        with pytest.raises(QueueFull, match="this request's 2 choices take 2 places"):
            await service.submit(gen([8], n=2, max_tokens=2))
        single.cancel()
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(lambda: service.submit(gen([8], n=2, max_tokens=2)))
        await trio.testing.wait_all_tasks_blocked()
        assert service.queue.waiting == 2  # two choices, two places: the queue is full
        with pytest.raises(QueueFull, match=r"2 of 2 places taken\)"):
            await service.submit(gen([9], max_tokens=2))
        nursery.cancel_scope.cancel()


async def test_choices_the_slots_cannot_hold_are_refused_naming_n(autojump_clock):
    service, _ex, _ = make_service(slots=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        with pytest.raises(Infeasible) as err:
            await service.submit(gen([5], n=3, max_tokens=2))
        assert err.value.field == "n"
        assert service.live_requests == 0 and service.queue.waiting == 0
        nursery.cancel_scope.cancel()


async def test_unset_max_tokens_is_the_room_every_choice_can_have_at_once(autojump_clock):
    # context 32, pool 12 blocks of 4; prompt 9 tokens, two shared blocks. One request
    # alone could have 32 - 9 = 23 tokens; three choices 12 + 2 x 2 = 18 blocks > 12.
    # Each may have (12 + 2 x 2) // 3 = 5 blocks: 20 positions, 11 answer tokens.
    service, _ex, _ = make_service(slots=3, num_blocks=12)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        assert service.scheduler.room(SequenceSpec([1] * 9, n=3)) == 11
        budget = unset_budget(service, [5] * 9, n=3)
        stream = await service.submit(gen([5] * 9, n=3, ignore_eos=True, max_tokens=budget))
        await read_choices(stream)
        assert [o.completion_tokens for o in stream.outcomes] == [11, 11, 11]  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()


async def test_a_failed_choice_fails_the_response_and_the_writer_ends_the_others_with_its_code(
    autojump_clock,
):
    from triollm.request import GenerationRequest, ServedModel
    from triollm.server.responses import ResponseWriter

    service, ex, counter = make_service(slots=3, num_blocks=16)
    req = GenerationRequest(kind="completion", model=None, prompt_ids=(5,), n=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        ex.grammar_fails.add(1)
        stream = await service.submit(gen([5], n=3, max_tokens=6))
        served = ServedModel("m", None, 32, 0)  # type: ignore[arg-type]
        writer = ResponseWriter(req, served, stream)
        body, status = await writer.whole()
        assert status == 400 and body["error"]["code"] == "grammar_failed"
        assert body["error"]["type"] == "invalid_request_error"
        first, _, third = stream.outcomes
        for other in (first, third):
            assert isinstance(other, Failed) and other.code is EndCode.GRAMMAR_FAILED
            assert other.message.startswith("choice 1 of the request failed")
        assert pool_is_full(service)
        nursery.cancel_scope.cancel()
    assert counter.rejections == {EndCode.GRAMMAR_FAILED: 3}
