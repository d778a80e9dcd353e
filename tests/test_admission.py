"""The admission queue against the real scheduler: bounds, budgets, the cancel/admit race.

Deterministic: trio's MockClock with autojump, wait_all_tasks_blocked, and direct
calls to the driver's one pass (``drive``) where an exact interleaving is the point.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from triollm.admission import AdmissionQueue, QueueClosed, QueueFull, QueueTimeout, retry_after
from triollm.outcomes import Refused
from triollm.scheduler import Infeasible, Scheduler, SchedulerConfig, SeqState
from triollm.spec import SequenceSpec


def make(slots: int = 1, waiters: int = 4, wait_s: float = 30.0, k: int | None = None):
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=8,
            block_size=4,
            slots=slots,
            chunk_tokens=8,
            step_rows=16,
            context_tokens=32,
            overtake_limit=k,
        )
    )
    released: list[int] = []
    queue = AdmissionQueue(sched, max_waiters=waiters, wait_s=wait_s, on_release=released.append)
    return sched, queue, released


def hold_slot(sched: Scheduler, queue: AdmissionQueue, n_prompt: int = 2, max_tokens: int = 2):
    seq = queue.enqueue(SequenceSpec(list(range(1, n_prompt + 1)), max_tokens))[0]
    assert seq in queue.drive()
    return seq


def test_retry_after_is_whole_seconds_and_at_least_one():
    assert retry_after(30.0) == 30
    assert retry_after(29.1) == 30
    assert retry_after(0.2) == 1
    assert retry_after(1e-9) == 1


async def test_arriving_to_a_full_queue_is_refused_at_once_with_retry_after():
    sched, queue, _ = make(slots=1, waiters=2, wait_s=12.5)
    hold_slot(sched, queue)
    queue.enqueue(SequenceSpec([1, 2], 2))[0]
    queue.enqueue(SequenceSpec([1, 2], 2))[0]
    with pytest.raises(QueueFull) as info:
        queue.enqueue(SequenceSpec([1, 2], 2))[0]
    assert info.value.retry_after_s == 13
    assert info.value.reason is Refused.QUEUE_FULL
    # the refused request left no trace in the scheduler
    assert sched.statistics().waiting == 2


async def test_a_request_that_can_never_run_is_infeasible_even_when_the_queue_is_full():
    sched, queue, _ = make(slots=1, waiters=1)
    hold_slot(sched, queue)
    queue.enqueue(SequenceSpec([1, 2], 2))[0]  # the one place is taken
    with pytest.raises(Infeasible) as info:  # not QueueFull: a retry could never run it
        queue.enqueue(SequenceSpec([1, 2], 2, n=2))
    assert info.value.field == "n"
    assert sched.statistics().waiting == 1


async def test_a_wait_past_the_budget_is_429_and_its_sequence_is_cancelled(autojump_clock):
    sched, queue, _ = make(slots=1, wait_s=5.0)
    hold_slot(sched, queue)
    seq = queue.enqueue(SequenceSpec([1, 2], 2))[0]
    start = trio.current_time()
    with pytest.raises(QueueTimeout) as info:
        await queue.wait_admitted(seq)
    assert trio.current_time() - start == pytest.approx(5.0)
    assert info.value.retry_after_s == 5
    assert sched.state(seq) is SeqState.CANCELLED
    assert queue.waiting == 0


async def test_a_client_leaving_while_queued_is_cancelled_not_timed_out(autojump_clock):
    sched, queue, released = make(slots=1, wait_s=5.0)
    hold_slot(sched, queue)
    seq = queue.enqueue(SequenceSpec([1, 2], 2))[0]
    with trio.move_on_after(1.0) as client:  # the client's scope, not the budget
        await queue.wait_admitted(seq)
    assert client.cancelled_caught  # Cancelled passed through the budget scope
    assert sched.state(seq) is SeqState.CANCELLED
    assert queue.waiting == 0
    assert released == []  # it never held a slot


async def test_waiters_are_admitted_when_capacity_frees(autojump_clock):
    sched, queue, _ = make(slots=1)
    holder = hold_slot(sched, queue)
    seq = queue.enqueue(SequenceSpec([1, 2], 2))[0]
    got: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)

        async def waiter():
            got.append(await queue.wait_admitted(seq))

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await trio.sleep(3)  # mock time passes; nothing frees, nothing is admitted
        assert got == []
        sched.cancel(holder)
        queue.signal()
        await trio.testing.wait_all_tasks_blocked()
        assert got == [pytest.approx(3.0)]
        assert sched.state(seq) is SeqState.PREFILLING
        nursery.cancel_scope.cancel()


async def test_coalesced_signals_lose_nothing(autojump_clock):
    """Many signals while the driver is busy collapse into one pass, which still
    admits everyone who fits, because it recomputes from state."""
    sched, queue, _ = make(slots=3, waiters=8)
    seqs = [queue.enqueue(SequenceSpec([1, 2], 2))[0] for _ in range(3)]
    async with trio.open_nursery() as nursery:
        for _ in range(50):
            queue.signal()  # 1 token pending, 49 absorbed
        await nursery.start(queue.run)
        results: list[float] = []
        for seq in seqs:
            nursery.start_soon(lambda s=seq: _collect(queue, s, results))
        await trio.testing.wait_all_tasks_blocked()
        assert len(results) == 3
        assert queue.passes <= 4  # one per enqueue-or-burst, not one per signal
        assert sched.statistics().running == 3
        nursery.cancel_scope.cancel()


async def _collect(queue: AdmissionQueue, seq: int, out: list[float]) -> None:
    out.append(await queue.wait_admitted(seq))


async def test_the_head_is_overtaken_at_most_k_times(autojump_clock):
    # 8 blocks of 4. A holder takes 4 blocks; the head needs 8 (cannot fit);
    # small followers need 1 block each.
    sched, queue, _ = make(slots=4, waiters=8, k=1)
    holder = queue.enqueue(SequenceSpec([1] * 8, 8))[0]  # 16 positions = 4 blocks
    assert queue.drive() == (holder,)
    head = queue.enqueue(SequenceSpec([1] * 16, 16))[
        0
    ]  # 32 positions = 8 blocks: waits for the holder
    small1 = queue.enqueue(SequenceSpec([1], 1))[0]
    small2 = queue.enqueue(SequenceSpec([1], 1))[0]
    assert queue.drive() == (small1,)  # one overtake allowed (K = 1)
    assert queue.drive() == ()  # small2 fits, but may not pass the head again
    assert sched.state(small2) is SeqState.WAITING
    sched.cancel(holder)
    sched.cancel(small1)
    assert queue.drive() == (head,)
    assert sched.state(small2) is SeqState.WAITING  # the head took the whole pool


async def waiting_client(queue, seq, seen, task_status=trio.TASK_STATUS_IGNORED):
    """A client waiting for admission whose cancel scope the test holds (to leave)."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await queue.wait_admitted(seq)
        seen["admitted"] = True
    seen["cancelled"] = scope.cancelled_caught


async def test_race_the_driver_admits_a_waiter_whose_client_just_left():
    """Order 1: the client's cancel and a free slot land together, and the driver's
    pass runs before the waiter task does. The waiter then wakes with Cancelled,
    finds itself ADMITTED, and gives the slot straight back."""
    sched, queue, released = make(slots=1)
    holder = hold_slot(sched, queue)
    seq = queue.enqueue(SequenceSpec([1, 2], 2))[0]
    seen: dict[str, bool] = {}

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(waiting_client, queue, seq, seen)
        await trio.testing.wait_all_tasks_blocked()
        # One instant, no checkpoint in between: the client leaves, the slot frees,
        # and the driver's pass runs first.
        scope.cancel()
        sched.cancel(holder)
        assert queue.drive() == (seq,)
        assert sched.state(seq) is SeqState.PREFILLING
    assert seen == {"cancelled": True}
    assert sched.state(seq) is SeqState.CANCELLED
    assert released == [seq]
    stats = sched.statistics()
    assert (stats.free_slots, stats.blocks_free) == (1, stats.blocks_total)


async def test_race_the_waiter_leaves_before_the_driver_runs():
    """Order 2: the waiter task processes its cancel first; it cancels its WAITING
    sequence, so the driver's pass never sees it."""
    sched, queue, released = make(slots=1)
    holder = hold_slot(sched, queue)
    seq = queue.enqueue(SequenceSpec([1, 2], 2))[0]
    seen: dict[str, bool] = {}

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(waiting_client, queue, seq, seen)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        sched.cancel(holder)
        await trio.testing.wait_all_tasks_blocked()  # the waiter runs first this time
        assert sched.state(seq) is SeqState.CANCELLED
        assert queue.drive() == ()
    assert seen == {"cancelled": True}
    assert released == []
    stats = sched.statistics()
    assert (stats.free_slots, stats.blocks_free, stats.waiting) == (1, stats.blocks_total, 0)


async def test_close_wakes_every_waiter_with_queue_closed(autojump_clock):
    sched, queue, _ = make(slots=1)
    hold_slot(sched, queue)
    seqs = [queue.enqueue(SequenceSpec([1, 2], 2))[0] for _ in range(2)]
    errors: list[type] = []

    async def waiter(seq: int) -> None:
        try:
            await queue.wait_admitted(seq)
        except QueueClosed as exc:
            errors.append(type(exc))

    async with trio.open_nursery() as nursery:
        for seq in seqs:
            nursery.start_soon(waiter, seq)
        await trio.testing.wait_all_tasks_blocked()
        queue.close()
    assert errors == [QueueClosed, QueueClosed]
    assert all(sched.state(s) is SeqState.CANCELLED for s in seqs)
    with pytest.raises(QueueClosed):
        queue.enqueue(SequenceSpec([1, 2], 2))[0]


async def test_one_driver_keeps_fcfs_with_at_most_k_overtakes_on_the_live_path(autojump_clock):
    """The same rule as above, but through the running driver (``queue.run``) and
    waiting clients (``wait_admitted``), released by finishes that signal: no call
    to ``drive`` anywhere. The head needs 2 blocks; followers need 1 each; K = 2."""
    sched = Scheduler(
        SchedulerConfig(num_blocks=4, block_size=4, slots=4, context_tokens=32, overtake_limit=2)
    )
    order: list[str] = []
    names: dict[int, str] = {}
    queue = AdmissionQueue(
        sched, max_waiters=8, wait_s=1e6, on_admit=lambda seq: order.append(names[seq])
    )

    async def client(name: str, prompt_len: int, max_tokens: int) -> None:
        seq = queue.enqueue(SequenceSpec([1] * prompt_len, max_tokens))[0]
        names[seq] = name
        await queue.wait_admitted(seq)

    def finish(name: str) -> None:
        (seq,) = [s for s, n in names.items() if n == name]
        sched.finish(seq)
        queue.signal()  # what the service does after every finish

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        for name, prompt, answer in [("X", 8, 4), ("H", 4, 4), ("F1", 2, 2), ("F2", 2, 2)]:
            nursery.start_soon(client, name, prompt, answer)  # X: 3 blocks, H: 2, F: 1
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(client, "F3", 2, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["X", "F1"]  # H does not fit beside X; F1 passes it (1 of K)
        finish("F1")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["X", "F1", "F2"]  # the second and last overtake
        finish("F2")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["X", "F1", "F2"]  # F3 fits, but the head was passed K times
        finish("X")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["X", "F1", "F2", "H", "F3"]  # the head first, then the rest
        nursery.cancel_scope.cancel()
