"""Why one task drives the admission queue: the lost wake-up, shown and measured.

Forma's queue (and ours, ``triollm.admission``) wakes waiters through a capacity
channel of size 1: every release offers a token with ``send_nowait`` and a pending
token absorbs the next, so a burst of releases costs one re-evaluation. Who reads
that channel matters.

- **Every waiter reads it** (the tempting design). A token goes to exactly one
  reader. If that reader may not enter (it does not fit, or FCFS puts someone
  ahead of it), it goes back to sleep and the token is gone, while a waiter that
  *could* enter never heard of it and sleeps until some later release.
- **One driver reads it** (ours). The driver recomputes admissibility from the
  state at every wake, for all waiters in FCFS order, so a token can never be
  spent on the wrong waiter.

Both designs run the same script on trio's ``MockClock``, so the times printed are
virtual seconds and the story is the same on every run: four blocks, all held;
A (first in line) and B each need two; one block is freed at t=1 s, another at
t=2 s, and the last two only at t=6 s. The first design is a toy (the server never
had it). The second is the server's own code: the real
:class:`~triollm.admission.AdmissionQueue` and its one driver task in front of a real
:class:`~triollm.scheduler.Scheduler`, whose four blocks are held by three running
sequences that end on the story's schedule.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
import trio.testing

# (time in virtual seconds, blocks freed then): the release schedule of the story
RELEASES: tuple[tuple[float, int], ...] = ((1.0, 1), (2.0, 1), (6.0, 2))
NEEDS: dict[str, int] = {"A": 2, "B": 2}  # in arrival (FCFS) order


@dataclass
class _Pool:
    free: int = 0
    queue: list[str] = field(default_factory=lambda: list(NEEDS))  # FCFS order
    could_enter_at: dict[str, float] = field(default_factory=dict)
    entered_at: dict[str, float] = field(default_factory=dict)
    start: float = field(default_factory=trio.current_time)  # each story's t=0

    def now(self) -> float:
        return trio.current_time() - self.start

    def head_fits(self) -> bool:
        return bool(self.queue) and NEEDS[self.queue[0]] <= self.free

    def note_admissible(self) -> None:
        # the instant the head could have entered, whoever is told about it
        if self.head_fits() and self.queue[0] not in self.could_enter_at:
            self.could_enter_at[self.queue[0]] = self.now()

    def enter(self, name: str) -> None:
        self.free -= NEEDS[name]
        self.queue.remove(name)
        self.entered_at[name] = self.now()
        self.note_admissible()  # the next in line may fit now


async def _releases(
    pool: _Pool,
    release: Callable[[int, int], None],
    signal: Callable[[], None],
    say: Callable[[str], None],
) -> None:
    for i, (at, blocks) in enumerate(RELEASES):
        await trio.sleep_until(pool.start + at)
        release(i, blocks)
        say(f"  t={pool.now():.1f} s  {blocks} block(s) freed, {pool.free} free: signal")
        pool.note_admissible()
        signal()


def _offer(channel: trio.MemorySendChannel[None]) -> Callable[[], None]:
    def signal() -> None:
        # a token already pending covers this release too (the coalescing signal)
        with contextlib.suppress(trio.WouldBlock):
            channel.send_nowait(None)

    return signal


async def every_waiter_reads(say: Callable[[str], None]) -> _Pool:
    """The broken design: each waiter loops on the capacity channel itself."""
    pool = _Pool()
    send, receive = trio.open_memory_channel[None](1)

    async def waiter(name: str) -> None:
        while True:
            await receive.receive()
            if pool.queue[0] == name and pool.head_fits():
                pool.enter(name)
                say(f"           {name} got the signal and enters")
                return
            why = "it does not fit" if pool.queue[0] == name else f"{pool.queue[0]} is ahead of it"
            say(f"           {name} got the signal but may not enter ({why}): back to sleep")

    async with trio.open_nursery() as nursery:
        for name in NEEDS:
            nursery.start_soon(waiter, name)
            await trio.testing.wait_all_tasks_blocked()  # A starts waiting before B

        def release(i: int, blocks: int) -> None:
            pool.free += blocks

        await _releases(pool, release, _offer(send), say)
        await trio.testing.wait_all_tasks_blocked()
        # No release is left in the story: whoever still waits would wait forever.
        nursery.cancel_scope.cancel()
    return pool


async def one_driver_reads(say: Callable[[str], None]) -> _Pool:
    """Our design, the server's own code: ``AdmissionQueue`` (one driver task that runs
    the Scheduler's FCFS pass at every wake) in front of a real ``Scheduler``.

    Four blocks of four positions, held by three running sequences of 1, 1 and 2
    blocks that end (are cancelled) on the story's schedule; A and B each reserve 2
    blocks (a 4-token prompt and 4 answer tokens). ``_Pool`` only keeps the story's
    clock: who could have entered when, read from the Scheduler's free count."""
    from triollm.admission import AdmissionQueue
    from triollm.scheduler import Scheduler, SchedulerConfig
    from triollm.spec import SequenceSpec

    pool = _Pool()
    scheduler = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, slots=5, context_tokens=8))
    holders = [scheduler.add(SequenceSpec([1] * n, max_tokens=n)) for n in (2, 2, 4)]
    scheduler.admit_waiting()  # 1 + 1 + 2 blocks: the pool is full
    names: dict[int, str] = {}

    def on_admit(seq_id: int) -> None:
        pool.enter(names[seq_id])
        say(f"           the driver admits {names[seq_id]}")

    queue = AdmissionQueue(scheduler, max_waiters=4, wait_s=60.0, on_admit=on_admit)

    async def wait(name: str) -> None:
        (seq_id,) = queue.enqueue(SequenceSpec([1] * 4, max_tokens=4))
        names[seq_id] = name
        await queue.wait_admitted(seq_id)

    def release(i: int, blocks: int) -> None:
        scheduler.cancel(holders[i])  # its blocks are back in the pool now
        pool.free = scheduler.statistics().blocks_free

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        async with trio.open_nursery() as waiters:
            for name in NEEDS:
                waiters.start_soon(wait, name)
                await trio.testing.wait_all_tasks_blocked()  # A queues before B
            await _releases(pool, release, queue.signal, say)
        nursery.cancel_scope.cancel()
    return pool


def stalls(pool: _Pool) -> dict[str, float]:
    """Seconds each waiter spent able to enter but not entered (inf: never entered)."""
    return {
        name: pool.entered_at.get(name, float("inf")) - could
        for name, could in pool.could_enter_at.items()
    }


def _stall_lines(pool: _Pool) -> list[str]:
    lines = []
    for name, could in pool.could_enter_at.items():
        if name in pool.entered_at:
            did = pool.entered_at[name]
            lines.append(
                f"  {name} could enter at t={could:.1f} s, entered at t={did:.1f} s: "
                f"stalled {did - could:.1f} s"
            )
        else:
            lines.append(
                f"  {name} could enter at t={could:.1f} s and never did: no signal is left for it"
            )
    return lines


async def _story(
    design: Callable[[Callable[[str], None]], Awaitable[_Pool]],
    title: str,
    say: Callable[[str], None],
) -> _Pool:
    say(title)
    pool = await design(say)
    for line in _stall_lines(pool):
        say(line)
    return pool


async def main(say: Callable[[str], None] = print) -> tuple[_Pool, _Pool]:
    """Tell both stories; return their pools (the tests read the stalls)."""
    readers = await _story(every_waiter_reads, "every waiter reads the capacity channel:", say)
    say("")
    driver = await _story(
        one_driver_reads, "one driver reads it (the server's AdmissionQueue, run for real):", say
    )
    return readers, driver


def configure(parser: argparse.ArgumentParser) -> None:
    """No options: the story is fixed so it prints the same lines every time."""


def run(args: argparse.Namespace) -> int:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return 0
