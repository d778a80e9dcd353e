"""The Service: one nursery that owns the batch loop, the admission driver and the HTTP server.

Theory of operation (read with ``admission.py``, ``plan.py`` and ``output.py``).

A request arrives as a frozen :class:`~triollm.spec.GenerationSpec` (``request.prepare``
made it). :meth:`Service.submit` has the output processor build its text pipelines and
channel, queues the spec's scheduler slice (:class:`~triollm.spec.SequenceSpec`) in the
admission queue, and waits for its admission.

The batch loop is one task. Each turn:

1. apply pending batch membership (``executor.add`` / ``remove``): only here, between
   steps, because the executor's state is being read by a worker thread during a step;
2. ``plan = scheduler.plan_step()``; an empty plan parks the loop on an event that the
   next admission sets (a sleep on an event, never on a timer);
3. ``result = await self.run_in_thread(plan)``: the forward pass runs in a worker
   thread, so the event loop keeps accepting requests and writing SSE while
   numpy/numba compute (the kernels release the GIL); the thread starts before the
   loop yields, so the handlers write the last step's events while this one computes;
4. ``finished = scheduler.commit(result)``, then the output processor
   (:class:`~triollm.output.OutputProcessor`) takes the result: each sampled token
   through its choice's text pipeline onto its request's channel, without ever
   awaiting a client (a client too far behind is cut);
5. signal the admission driver: a step may have freed a slot.

The ``n`` choices of one prompt are ``n`` sequences of one scheduler group (its rule
10: admitted together, the prompt's blocks shared), each with its own sampler and
text pipeline, streaming into the request's *one* channel (``output.py`` says why).
The events and the metrics hooks live in ``events.py``; the text rules in
``textstream.py``; the memory arithmetic in ``sizing.py``.

Cancellation: a client that leaves makes its handler's cancel scope fire; the HTTP
edge then calls :meth:`~triollm.output.RequestStream.close` from a ``finally`` block.
``close`` is synchronous on purpose: inside a cancelled scope every ``await`` raises at
once, so cleanup that awaits would silently not happen. It cancels the sequence in the
scheduler, whose blocks are back in the pool before ``close`` returns.

Trap: every change that could let a waiter in (finish, cancel, step) must call
``self.queue.signal()``; a missed signal is not a crash but a stall.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import trio

from triollm.admission import AdmissionQueue
from triollm.errors import FieldError
from triollm.events import (
    Completed,
    Delta,
    Ended,
    Failed,
    NullObserver,
    Observer,
    Outcome,
    StepKind,
    StepRecorder,
    TokenInfo,
)
from triollm.outcomes import EndCode
from triollm.output import (
    SHUT_DOWN_MESSAGE,
    Choice,
    OutputProcessor,
    RequestStream,
    TokenTexts,
)
from triollm.plan import FinishReason, SequenceFailure, StepPlan, StepResult
from triollm.scheduler import Scheduler
from triollm.spec import GenerationSpec
from triollm.textstream import Detokenizer

if TYPE_CHECKING:
    from triollm.model.sampling import SamplingParams

__all__ = [
    "Completed",
    "Delta",
    "Ended",
    "Executor",
    "Failed",
    "Lifecycle",
    "Outcome",
    "RequestStream",
    "Service",
    "ServiceConfig",
    "TokenInfo",
]

log = logging.getLogger("triollm.service")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ServiceConfig:
    """The service's own knobs (the scheduler has its own config)."""

    queue_depth_per_slot: int = 8  # waiters per slot; Forma's figure: bounded, never a backlog
    queue_wait_s: float = 30.0  # wait budget; past it a waiter gets 429 (and Retry-After: 30)
    # Steps of undelivered output a client may fall behind before it is cut off. Each
    # step gives a request at most one delta, so this is also a bound in tokens. 256 is
    # Forma's figure: at ~20 steps/s about 12 s of jitter, and only a few KB per request.
    stream_buffer_steps: int = 256
    # An unset max_tokens: request.prepare's rule reads it (None: the room left).
    max_tokens_default: int | None = None

    def __post_init__(self) -> None:
        if self.queue_depth_per_slot < 1:
            raise ValueError(f"queue_depth_per_slot must be >= 1, got {self.queue_depth_per_slot}")
        if not (self.queue_wait_s > 0 and math.isfinite(self.queue_wait_s)):
            raise ValueError(f"queue_wait_s must be a positive number, got {self.queue_wait_s}")
        if self.stream_buffer_steps < 1:
            raise ValueError(f"stream_buffer_steps must be >= 1, got {self.stream_buffer_steps}")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")


class Lifecycle(enum.Enum):
    """Where the service is in its life; the probes (``/health``, ``/ready``) answer
    from it. STARTING -> READY (the warm-up completed) -> DRAINING (shutdown began:
    nobody new is admitted, running streams finish); any state -> FAILED (the batch
    loop failed: every request ended, the queue closed). FAILED is final: a shutdown
    that follows it does not make the probes forget why the process is useless."""

    STARTING = "warming up"
    READY = "ready"
    DRAINING = "shutting down"
    FAILED = "failed"


class Executor(Protocol):
    """What the batch loop needs from :class:`triollm.batch.Batch` (tests pass a fake)."""

    def add(self, seq_id: int, spec: GenerationSpec, choice: int = 0) -> None: ...
    def remove(self, seq_id: int) -> None: ...
    def run(self, plan: StepPlan) -> StepResult: ...


# --------------------------------------------------------------------------- the service


class Service:
    """Scheduler + executor + admission queue, driven by tasks in one nursery.

    Build it, then ``await nursery.start(service.run)`` (optionally with a
    ``frontend``, the HTTP server, started in the same nursery); ``submit`` from
    request handlers.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        detokenizer: Callable[[Sequence[int]], Detokenizer],
        token_texts: TokenTexts | None = None,
        config: ServiceConfig | None = None,
        observer: Observer | None = None,
        recorder: StepRecorder | None = None,
        step_runner: Callable[[StepPlan], Awaitable[StepResult]] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        # How a step runs: in a worker thread by default. Tests pass an in-loop runner
        # they can gate, because a worker thread is invisible to MockClock and
        # wait_all_tasks_blocked (the clock would autojump while the thread computes).
        self.step_runner = step_runner or self.run_in_thread
        # The thread runner yields once its step is computing, which is when the
        # handlers the last dispatch woke should write their events; the loop then
        # needs no checkpoint of its own in front of the next step (run_in_thread).
        # A runner swapped in later (tests/server/serverkit.StepGate) wraps this one.
        self._runner_yields = step_runner is None
        self.config = config or ServiceConfig()
        self.output = OutputProcessor(
            detokenizer=detokenizer,
            stream_buffer_steps=self.config.stream_buffer_steps,
            observer=observer or NullObserver(),
            retire=self._retire,
            stop=lambda seq_id: self.scheduler.finish(seq_id, FinishReason.STOP),
            token_texts=token_texts,
        )
        self.recorder = recorder or StepRecorder()
        slots = scheduler.config.slots
        self.queue = AdmissionQueue(
            scheduler,
            max_waiters=slots * self.config.queue_depth_per_slot,
            wait_s=self.config.queue_wait_s,
            on_admit=self._on_admit,
            on_readmit=self._on_readmit,
            on_release=self._on_release,
        )
        # Batch membership changes wait for the safe point between steps (the worker
        # thread reads the executor's per-sequence state during a step).
        self._to_add: list[int] = []
        self._to_remove: list[int] = []
        self._work = trio.Event()  # set when an admission may have made a plan non-empty
        self._changed = trio.Event()  # set (and replaced) on every state change, for waiters
        self._frontend_done = trio.Event()
        self.state = Lifecycle.STARTING
        self._failure: str | None = None  # why the batch loop stopped (state FAILED)
        self._drain_ends: float | None = None  # when the shutdown's grace runs out

    @property
    def observer(self) -> Observer:
        """The metrics hooks (the output processor calls most of them)."""
        return self.output.observer

    @observer.setter
    def observer(self, observer: Observer) -> None:
        self.output.observer = observer

    @property
    def ready(self) -> bool:
        return self.state is Lifecycle.READY

    @property
    def closing(self) -> bool:
        """Shutting down: nobody new is admitted, the running streams drain."""
        return self.state is Lifecycle.DRAINING

    @property
    def failed(self) -> str | None:
        """Why the batch loop stopped (then never ready again); None unless FAILED."""
        return self._failure if self.state is Lifecycle.FAILED else None

    @property
    def outcomes(self) -> deque[tuple[int, FinishReason | EndCode]]:
        """The last choices' (seq_id, how it ended), for tests and tools."""
        return self.output.outcomes

    # ------------------------------------------------------------------ the task tree

    async def run(
        self,
        frontend: Callable[..., Awaitable[Any]] | None = None,
        *,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the admission driver and the batch loop (and ``frontend``, if given)
        until cancelled, or until the frontend returns (it has shut down)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.queue.run)
            nursery.start_soon(self._batch_loop)
            started = None
            if frontend is not None:
                started = await nursery.start(self._run_frontend, frontend)
            task_status.started(started)
            if frontend is not None:
                # The frontend ends after its graceful shutdown; take the rest down with it.
                await self._frontend_done.wait()
                self.output.end_admitted(EndCode.SHUTDOWN, SHUT_DOWN_MESSAGE)
                nursery.cancel_scope.cancel()

    async def _run_frontend(
        self,
        frontend: Callable[..., Awaitable[Any]],
        *,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            await frontend(task_status=task_status)
        finally:
            self._frontend_done.set()

    async def warm_up(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Run one tiny request through the whole path (prefill and decode), so the
        kernels are compiled before /ready says yes; then the service is ready. Not
        counted in the metrics.

        Raises RuntimeError if it does not complete: a server whose first step
        fails must not report itself ready."""
        stream = await self.submit(GenerationSpec(prompt_ids, sampling, 2, internal=True))
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()
        if not isinstance(stream.outcome, Completed):
            detail = stream.outcome.message if stream.outcome else "no outcome"
            raise RuntimeError(f"the warm-up request failed: {detail}")
        if self.state is Lifecycle.STARTING:
            self.state = Lifecycle.READY

    def begin_shutdown(self, drain_s: float | None = None) -> None:
        """Stop admitting (waiters get 503); running streams continue, for up to
        ``drain_s`` seconds if given (the grace: it sets :meth:`retry_after_s`)."""
        if drain_s is not None and self.state is not Lifecycle.DRAINING:
            self._drain_ends = trio.current_time() + drain_s
        if self.state is not Lifecycle.FAILED:  # a failure stays the answer to the probes
            self.state = Lifecycle.DRAINING
        self.queue.close()
        self._work.set()
        self.notify()

    def retry_after_s(self) -> int:
        """During the drain, the ``Retry-After`` a refused newcomer gets: the seconds
        until the drain ends (at least 1), when a restarted server may answer."""
        if self._drain_ends is None:
            return 1
        return max(1, math.ceil(self._drain_ends - trio.current_time()))

    def end_running(self) -> None:
        """The shutdown's grace ran out: end every admitted request now with a
        ``shutdown`` error, which its handler still writes (event, then ``[DONE]``)."""
        self.output.end_admitted(EndCode.SHUTDOWN, SHUT_DOWN_MESSAGE)

    # ------------------------------------------------------------------ requests

    async def submit(self, spec: GenerationSpec) -> RequestStream:
        """Queue a request of ``spec.n`` answers to one prompt (OpenAI's ``n``) and wait
        for their admission, all together; returns their stream.

        The choices are one scheduler group (its rule 10): the prompt's full blocks
        are computed once and shared, each choice has its own answer blocks, sampler
        (``spec.choice_sampling(i)``) and text pipeline (stop strings, tool calls), and
        ends on its own: a choice that fails ends alone, like any sequence.

        ``spec.priority`` (smaller is served earlier; vLLM's convention) reaches the
        policy's views. A non-zero one under a policy that does not order by it is
        refused, as vLLM refuses one without priority scheduling: a client that
        asked to go first and silently did not would draw the wrong conclusion.

        Raises ``QueueFull`` / ``QueueTimeout`` (429; the choices take ``n`` places in
        the queue), ``QueueClosed`` (503), the scheduler's ``Infeasible`` (naming
        ``n`` when the group could never fit) or ``FieldError`` (400); a client that
        leaves while queued gets ``Cancelled`` with nothing left behind.
        """
        if spec.priority != 0 and not self.scheduler.policy.orders_by_priority:
            raise FieldError(
                "priority",
                f"'priority' is {spec.priority}, but this server's scheduling policy "
                f"({self.scheduler.policy.name}) does not order by priority and would "
                "ignore it; leave it out or send 0",
            )
        # Everything that can fail is built before enqueue: after it, sequences exist.
        pending = self.output.pending(spec)
        seq_ids = self.queue.enqueue(spec.sequence())
        self.output.track(pending, seq_ids)
        self.notify()
        try:
            await self.queue.wait_admitted(seq_ids[0])
        except BaseException:
            # Sync cleanup (we may be cancelled). The queue already cancelled every member.
            self.output.untrack(pending)
            self.notify()
            raise
        return self.output.stream(pending)

    async def submit_prompts(self, specs: Sequence[GenerationSpec]) -> RequestStream:
        """:meth:`submit` for a list of prompts (``/v1/completions``): each prompt's
        ``n`` choices are a group as in :meth:`submit`, the groups queued at once, and
        the request waits until every one is admitted; one stream carries them all,
        prompt ``i``'s choice ``j`` as index ``i * n + j`` (OpenAI's numbering).

        Admission is all or nothing: the scheduler first checks that the prompts'
        choices fit the slots and the pool together (``Infeasible`` naming ``prompt``),
        and a group refused or timed out while others were admitted ends them (their
        blocks back) before the refusal is raised.
        """
        if len(specs) == 1:
            return await self.submit(specs[0])
        if specs[0].priority != 0 and not self.scheduler.policy.orders_by_priority:
            return await self.submit(specs[0])  # its FieldError, as for one prompt
        self.scheduler.check_prompts([spec.sequence() for spec in specs])
        pending = self.output.pending_prompts(specs)
        tickets: list[int] = []
        taken = 0
        try:
            for which, spec in enumerate(specs):
                seq_ids = self.queue.enqueue(spec.sequence())
                self.output.track(pending, seq_ids, which)
                tickets.append(seq_ids[0])
            self.notify()
            for ticket in tickets:
                await self.queue.wait_admitted(ticket)
                taken += 1
        except BaseException:
            # Sync cleanup (we may be cancelled): the groups never waited for leave the
            # queue; the admitted ones end now; nothing of the request is left.
            for ticket in tickets[taken:]:  # the one that failed its wait has left
                self.queue.withdraw(ticket)
            for request in pending.requests[:taken]:
                for choice in request.members:
                    self.output.abandon(
                        choice, EndCode.CLIENT_CLOSED, "another prompt of the request was refused"
                    )
            self.output.untrack(pending)
            self.notify()
            raise
        return self.output.stream(pending)

    def _on_admit(self, seq_id: int) -> None:
        live = self.output.live.get(seq_id)
        if live is None:
            # Admission of a sequence we no longer track (impossible while the queue and
            # the service stay in step); give its slot back rather than leak it.
            self.scheduler.cancel(seq_id)
            return
        live.admitted_at = trio.current_time()
        live.cached_tokens = self.scheduler.sequence(seq_id).cached_tokens
        self._to_add.append(seq_id)
        if not live.internal and live.index == 0:
            # A request's prompt is counted once, however many choices share it.
            self.observer.admitted(
                len(live.prompt_ids), live.admitted_at - live.arrived, len(live.request.members)
            )
        self._work.set()
        self.notify()

    def _on_readmit(self, seq_id: int) -> None:
        """A preempted sequence the driver let back in. It is still in the batch and
        its request still streams (so not ``_on_admit``: that would add it twice);
        only the loop, which may have parked on an empty plan, must wake."""
        self._work.set()
        self.notify()

    def _on_release(self, seq_id: int) -> None:
        """An admitted sequence whose client left before taking its slot (the race)."""
        live = self.output.live.pop(seq_id, None)
        if live is not None and live.in_batch:
            self._to_remove.append(seq_id)
        self.notify()

    # ------------------------------------------------------------------ ending requests

    def _retire(self, live: Choice, cancel: bool) -> None:
        """The service's part of a choice's end (``OutputProcessor.end`` calls it)."""
        if cancel:
            self.scheduler.cancel(live.seq_id)  # blocks back in the pool now
            # The freed blocks may let a running sequence the pool had starved
            # (free-slot) grow again; a loop parked on an empty plan must look.
            self._work.set()
        if live.in_batch:
            self._to_remove.append(live.seq_id)
        self.queue.signal()
        self.notify()

    # ------------------------------------------------------------------ the batch loop

    def _apply_membership(self) -> None:
        """The safe point: no step is running, so the executor may change."""
        removes, self._to_remove = self._to_remove, []
        for seq_id in removes:
            self.executor.remove(seq_id)
        adds, self._to_add = self._to_add, []
        for seq_id in adds:
            live = self.output.live.get(seq_id)
            if live is None or live.outcome is not None:
                continue  # left before it ever ran
            self.executor.add(seq_id, live.spec, live.index)
            live.in_batch = True

    async def _batch_loop(self) -> None:
        """Run steps forever; if anything beyond a step fails, fail safe and stop.

        A step's own failure is handled inside (the step's requests fail, the loop
        goes on), and so is one request's text pipeline (that request fails).
        Anything else -- commit, dispatch, an observer, membership -- means the
        loop's state can no longer be trusted, so it is not restarted: every
        admitted request ends now with an ``internal`` error event and its blocks
        go back, the queue closes (waiters and newcomers get 503), and ``/ready``
        says ``failed`` so an orchestrator replaces the process. Without this the
        exception would end the task silently (or take the server down) and every
        open stream would hang with no outcome.
        """
        try:
            await self._run_steps()
        except Exception as exc:
            log.exception("the batch loop failed; ending every request, refusing new ones")
            self._fail_everything(f"the server's batch loop failed: {exc!r}")

    def _fail_everything(self, message: str) -> None:
        self._failure = message
        self.state = Lifecycle.FAILED
        self.queue.close(message)
        for live in list(self.output.live.values()):
            if live.admitted_at is None:
                continue  # still queued: close() woke it with QueueClosed
            try:
                self.output.fail(live, EndCode.INTERNAL, message)
            except Exception:  # the failing part may be on this path too
                log.exception("seq %d: ending it failed; closing its stream", live.seq_id)
                self.output.live.pop(live.seq_id, None)
                live.outcome = self.output.failed(live, EndCode.INTERNAL, message)
                live.request.send.close()
                try:
                    self.scheduler.cancel(live.seq_id)
                except Exception:
                    log.exception("seq %d: its blocks could not be returned", live.seq_id)
        self.notify()

    async def _run_steps(self) -> None:
        while True:
            self._apply_membership()
            plan = self.scheduler.plan_step()
            if plan.is_empty:
                self._work = trio.Event()
                self.notify()
                await self._work.wait()
                continue
            try:
                result = await self.step_runner(plan)
            except Exception as exc:
                self.scheduler.discard_step()
                # An executor that names the offending sequences (batch.BadChunks:
                # checked before anything ran) costs only those; the others are
                # planned again next turn. Failing the whole step instead would let
                # one bad request kill every request sharing its forward pass.
                culprits: frozenset[int] = getattr(exc, "seq_ids", frozenset())
                if culprits:
                    log.error("step %d refused sequences %s: %s", plan.step, sorted(culprits), exc)
                else:
                    log.exception("step %d failed", plan.step)
                for chunk in plan.chunks:
                    if culprits and chunk.seq_id not in culprits:
                        continue
                    live = self.output.live.get(chunk.seq_id)
                    if live is not None:
                        self.output.fail(live, EndCode.INTERNAL, f"the step failed: {exc}")
                    else:
                        self.scheduler.cancel(chunk.seq_id)
                continue
            finished = {f.seq_id: f for f in self.scheduler.commit(result)}
            rec = self.recorder.record(plan, result)
            if not self._only_internal(plan):  # the warm-up's steps stay out of the metrics
                kind = StepKind.of(rec.prefill_rows)
                self.observer.step(rec.rows, rec.width, kind, rec.seconds)
            self.output.record_scores(result.scores)
            self.output.dispatch(result.sampled, finished)
            self._fail_sequences(result.failed)
            self.queue.signal()  # a step may have freed a slot (and a signal is cheap)
            self.notify()
            if not self._runner_yields:
                # A runner that may not yield at all (a test's, the looplag benchmark's
                # inline one): without this, no handler would write until the loop idles.
                await trio.lowlevel.checkpoint()

    async def run_in_thread(self, plan: StepPlan) -> StepResult:
        """Run ``executor.run(plan)`` in a worker thread and wait for its result.

        The thread is started before this task yields. ``trio.to_thread.run_sync``
        yields first (its CapacityLimiter's checkpoint), so every SSE handler the
        last dispatch woke wrote its event *in front of* the step: on a small model,
        where a step is a few milliseconds, that was a fixed cost per token
        (docs/performance.md, "The server path"). Here they write while it computes.

        Not cancellable (``Abort.FAILED``): the thread writes the KV pool, so a
        cancelled loop (shutdown) still waits for the step; the cancellation lands
        at the loop's next checkpoint. The thread comes from trio's own cache of
        idle workers (``start_thread_soon``), the one ``to_thread`` uses.
        """
        # Hazard: nothing below is a checkpoint for a task that is not cancelled, and
        # wait_task_rescheduled waits for the thread even when it is. Without this a
        # cancelled loop (shutdown) would start step after step until its plan is empty.
        # It raises only when cancelled; otherwise it does not yield.
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: Any) -> None:  # an outcome.Outcome, called in the thread
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        # Hazard: self.executor.run is looked up now, not at __init__: a benchmark
        # (bench/bench_serverpath.py) times the step by wrapping it on the instance.
        trio.lowlevel.start_thread_soon(partial(self.executor.run, plan), deliver)
        result: StepResult = await trio.lowlevel.wait_task_rescheduled(
            lambda _: trio.lowlevel.Abort.FAILED
        )
        return result

    def _fail_sequences(self, failures: Sequence[SequenceFailure]) -> None:
        """Sequences the Batch could not sample (their grammar failed): each ends
        alone, with an error event; the scheduler did not advance them."""
        for failure in failures:
            log.warning("seq %d: %s", failure.seq_id, failure.message)
            live = self.output.live.get(failure.seq_id)
            if live is not None:
                self.output.fail(live, EndCode.GRAMMAR_FAILED, failure.message)
            else:
                self.scheduler.cancel(failure.seq_id)

    # ------------------------------------------------------------------ observation

    def notify(self) -> None:
        """Wake everything parked in :meth:`wait_until` (after any state change)."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait (on events, not a timer) until ``predicate()`` holds. For tests and
        tools; the predicate is re-checked after every state change of this service,
        so it must read this service's state: a flag some other task sets after the
        service's last change (a client recording its outcome) is never re-checked."""
        while not predicate():
            await self._changed.wait()

    def _only_internal(self, plan: StepPlan) -> bool:
        lives = [self.output.live.get(c.seq_id) for c in plan.chunks]
        return all(live is not None and live.internal for live in lives)

    @property
    def internal_running(self) -> int:
        """Internal requests (the warm-up) holding a slot: hidden from the gauges."""
        return sum(
            1
            for live in self.output.live.values()
            if live.internal and live.admitted_at is not None
        )

    @property
    def live_requests(self) -> int:
        return len(self.output.live)
