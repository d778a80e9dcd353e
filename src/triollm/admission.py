"""The admission queue: a bounded wait for a slot, driven by one task.

Theory of operation.

1. A request *enqueues* (sync, :meth:`AdmissionQueue.enqueue`): if the queue already
   holds ``max_waiters`` it is refused at once with :class:`QueueFull` (429); if
   it can never run, the scheduler's ``check_group`` raises ``Infeasible`` (400). Otherwise
   it becomes a WAITING sequence in the scheduler, which stamps it with an arrival
   ticket, and a :class:`_Waiter` here.
2. It then *waits* (:meth:`AdmissionQueue.wait_admitted`) on its own event, under
   a cancel scope whose deadline is the wait budget. That deadline is a scope of
   its own, nested inside the handler's: when it fires, the scope catches its own
   cancellation and we answer 429 :class:`QueueTimeout`; when the *client* leaves,
   the outer scope's ``Cancelled`` passes straight through ours (a scope only
   catches a cancellation it caused). So "timed out" and "client left" stay two
   different outcomes, the trio form of Go's separate timer beside ``ctx``.
3. One driver task (:meth:`AdmissionQueue.run`) sleeps on a capacity channel of
   size 1. Arrivals, finishes, cancels and every step offer a token with
   ``send_nowait``; a pending token absorbs the next (``WouldBlock`` ignored). At
   each wake the driver calls the scheduler's pure ``admit_waiting()``, which makes
   one FCFS pass with bounded overtaking over *all* waiters and says who got in.
   Nothing is counted from the signals: admissibility is recomputed from state,
   so a coalesced signal loses nothing, and a signal after a state change always
   leaves a token behind for the next pass.

Why one driver and not each waiter watching the channel: FCFS and the overtake
count are global. With N readers, the one that wins a signal may be one the rules
forbid to enter, and the rest sleep until the next release (a lost wake-up).

The race (tested both ways in tests/test_admission.py): a client may leave in the
same instant the driver admits it. Both orders end with the slot back:

- the waiter runs first: it marks itself GONE and cancels its WAITING sequence,
  so the driver's next pass never sees it;
- the driver runs first: it marks the waiter ADMITTED; the waiter then wakes with
  ``Cancelled``, sees ADMITTED, and cancels the now-running sequence.

Exactly one transition out of WAITING happens, and both happen on the event
loop thread without an ``await`` in between, so no lock is needed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import trio

from triollm.outcomes import Refused
from triollm.spec import SequenceSpec


class Refusal(Exception):
    """A capacity refusal (HTTP 429): not the client's fault, try again later."""

    reason: ClassVar[Refused]

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Refusal):
    reason = Refused.QUEUE_FULL


class QueueTimeout(Refusal):
    reason = Refused.QUEUE_TIMEOUT


class QueueClosed(Exception):
    """The service is shutting down; nobody else is admitted (HTTP 503)."""


class AdmissionScheduler(Protocol):
    """The part of :class:`triollm.scheduler.Scheduler` the queue uses."""

    def add_group(self, spec: SequenceSpec) -> tuple[int, ...]: ...
    def check_group(self, spec: SequenceSpec) -> None: ...
    def admit_waiting(self) -> tuple[int, ...]: ...
    def cancel(self, seq_id: int) -> None: ...


class WaiterState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"  # the driver let it in; it holds a slot and blocks
    CLOSED = "closed"  # the queue closed while it waited
    GONE = "gone"  # it left (client gone, timed out, or closed); its sequence is cancelled


@dataclass(eq=False)
class _Waiter:
    """One request's wait: its sequence, or the members of its group (OpenAI's ``n``),
    which the scheduler admits in one pass or not at all (its rule 10)."""

    seq_ids: tuple[int, ...]
    arrived: float
    resolved: trio.Event
    state: WaiterState = WaiterState.WAITING
    admitted: int = 0  # members the driver has let in so far

    @property
    def seq_id(self) -> int:
        return self.seq_ids[0]


def retry_after(wait_s: float) -> int:
    """Whole seconds for ``Retry-After``: the wait budget rounded up, never below 1.

    The budget, not a service-time estimate: it is the one figure we can promise
    (a request that waited that long was refused), and HTTP wants an integer.
    """
    return max(1, math.ceil(wait_s))


class AdmissionQueue:
    """Bounded waiting for admission in front of the scheduler.

    ``on_admit(seq_id)`` is called (sync, from the driver) for each sequence the
    moment it is admitted, before its waiter wakes: the service uses it to put the
    sequence into the batch before the next step can plan it. ``on_readmit(seq_id)``
    is called instead for a sequence the pass admitted that is not a waiter here: a
    preempted one coming back (policy preempt), whose request never stopped
    streaming; the service only has to wake its batch loop, which may be parked.
    ``on_release(seq_id)`` is called when a sequence that was admitted is given back
    here (its client left in the race above).

    Trap: :meth:`signal` must be called after *every* change that could admit
    someone (a finish, a cancel, a step). Forgetting one is not a crash but a stall:
    waiters sleep until some unrelated event wakes the driver.
    """

    def __init__(
        self,
        scheduler: AdmissionScheduler,
        *,
        max_waiters: int,
        wait_s: float,
        on_admit: Callable[[int], None] = lambda seq_id: None,
        on_readmit: Callable[[int], None] = lambda seq_id: None,
        on_release: Callable[[int], None] = lambda seq_id: None,
    ) -> None:
        if max_waiters < 1:
            raise ValueError(f"max_waiters must be at least 1, got {max_waiters}")
        if not wait_s > 0:
            raise ValueError(f"wait_s must be positive, got {wait_s}")
        self._scheduler = scheduler
        self.max_waiters = max_waiters
        self.wait_s = wait_s
        self._on_admit = on_admit
        self._on_readmit = on_readmit
        self._on_release = on_release
        # Invariant: every key is a WAITING sequence in the scheduler. A group's waiter
        # is here once per member, so the bound counts sequences, not requests.
        self._waiters: dict[int, _Waiter] = {}
        # Every waiter from enqueue until its wait_admitted returns (the driver may
        # admit it before the caller starts waiting), under its first sequence's id.
        self._tickets: dict[int, _Waiter] = {}
        self._wake_send, self._wake_recv = trio.open_memory_channel[None](1)
        self._closed = False
        self._closed_reason = "the server is shutting down"
        self.passes = 0  # driver passes (for tests: proves coalescing)

    # ------------------------------------------------------------------ sync core

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def signal(self) -> None:
        """Offer one capacity token; a pending one absorbs it. Never blocks."""
        try:
            self._wake_send.send_nowait(None)
        except trio.WouldBlock:
            pass  # a wake-up is already pending: the driver will recompute from state
        except trio.ClosedResourceError:
            pass  # the driver has stopped (shutdown)

    def enqueue(self, spec: SequenceSpec) -> tuple[int, ...]:
        """Take a place in the queue for the ``spec.n`` sequences of one request, or be
        refused now. Returns their ids; one wait (:meth:`wait_admitted` with the first
        id) admits them together (a group: the scheduler's rule 10).

        The request takes ``spec.n`` places of ``max_waiters``: the bound is on the work
        queued in front of a newcomer, and a group is ``n`` sequences of it (it will
        hold ``n`` slots). ``spec.priority`` goes to the scheduler as it is: the policy
        decides what it means (the driver only runs the scheduler's pass, in the
        policy's order). Raises :class:`QueueFull`, :class:`QueueClosed`, or the
        scheduler's ``Infeasible`` (a request that could never run is refused before it
        queues, naming ``n`` for a group too large) or its ``FieldError`` for a
        priority out of range.
        """
        n = spec.n
        if self._closed:
            raise QueueClosed(self._closed_reason)
        # what can never run is refused as such, before the bound (a retry cannot cure it)
        self._scheduler.check_group(spec)
        if len(self._waiters) + n > self.max_waiters:
            asked = "" if n == 1 else f"; this request's {n} choices take {n} places"
            raise QueueFull(
                f"the admission queue is full ({len(self._waiters)} of {self.max_waiters} "
                f"places taken{asked}); retry later",
                retry_after(self.wait_s),
            )
        seq_ids = self._scheduler.add_group(spec)
        waiter = _Waiter(seq_ids, trio.current_time(), trio.Event())
        for seq_id in seq_ids:
            self._waiters[seq_id] = waiter
        self._tickets[waiter.seq_id] = waiter
        self.signal()
        return seq_ids

    def withdraw(self, seq_id: int) -> None:
        """Take back a ticket nobody will wait for (another group of the same request
        was refused): its members leave as a cancelled wait's do. Sync."""
        waiter = self._tickets.pop(seq_id, None)
        if waiter is not None:
            self._leave(waiter)

    def drive(self) -> tuple[int, ...]:
        """One admission pass (what the driver does at each wake). Sync, so tests
        can run it at an exact point to order the cancel/admit race."""
        self.passes += 1
        admitted = self._scheduler.admit_waiting()
        for seq_id in admitted:
            waiter = self._waiters.pop(seq_id, None)
            if waiter is None:
                # Not a waiter of ours: a preempted sequence (policy preempt) re-entering.
                # Its request is still streaming; the service never stopped owning it.
                # Hazard: the batch loop may be parked on an empty plan (the head in
                # front of it has just left), and nothing else would wake it.
                self._on_readmit(seq_id)
                continue
            self._on_admit(seq_id)
            waiter.admitted += 1
            if waiter.admitted == len(waiter.seq_ids):  # a group: all in this same pass
                waiter.state = WaiterState.ADMITTED
                waiter.resolved.set()
        return admitted

    def close(self, reason: str = "the server is shutting down") -> None:
        """Stop admitting: every waiter is woken with :class:`QueueClosed` (``reason``)."""
        self._closed = True
        self._closed_reason = reason
        for waiter in set(self._waiters.values()):
            waiter.state = WaiterState.CLOSED
            waiter.resolved.set()
        self._wake_send.close()

    def _leave(self, waiter: _Waiter) -> None:
        """Undo a wait that did not end in a taken slot. Sync: it runs in ``finally``
        under a cancelled scope, where any ``await`` would raise at once."""
        was = waiter.state
        waiter.state = WaiterState.GONE
        for seq_id in waiter.seq_ids:  # every member, whatever the driver did
            self._waiters.pop(seq_id, None)
            self._scheduler.cancel(seq_id)
            if was is WaiterState.ADMITTED:
                self._on_release(seq_id)
        # A head that leaves may unblock the followers it was holding back.
        self.signal()

    # ------------------------------------------------------------------ async shell

    async def wait_admitted(self, seq_id: int) -> float:
        """Wait until the driver admits ``seq_id`` (a group: its first member, and then
        every member is admitted); returns the seconds waited.

        Raises :class:`QueueTimeout` when the wait budget runs out,
        :class:`QueueClosed` on shutdown; a client that leaves gets ``Cancelled``
        (the caller's scope), and in every one of those cases the sequence is
        cancelled and any slot it was given goes back before this returns.
        """
        waiter = self._tickets[seq_id]
        taken = False
        try:
            with trio.CancelScope(deadline=waiter.arrived + self.wait_s):
                await waiter.resolved.wait()
            if waiter.state is WaiterState.ADMITTED:
                taken = True
                return trio.current_time() - waiter.arrived
            if waiter.state is WaiterState.CLOSED:
                raise QueueClosed(self._closed_reason)
            raise QueueTimeout(
                f"waited {self.wait_s:g} s for a slot without being admitted; retry later",
                retry_after(self.wait_s),
            )
        finally:
            del self._tickets[seq_id]
            if not taken:
                self._leave(waiter)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The driver: one pass per wake until :meth:`close`."""
        task_status.started()
        async for _ in self._wake_recv:
            self.drive()
