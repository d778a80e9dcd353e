"""The Service: one nursery that owns the batch loop, the admission driver and the HTTP server.

Theory of operation (read with ``admission.py`` and ``plan.py``).

The batch loop is one task. Each turn:

1. apply pending batch membership (``executor.add`` / ``remove``): only here, between
   steps, because the executor's state is being read by a worker thread during a step;
2. ``plan = scheduler.plan_step()``; an empty plan parks the loop on an event that the
   next admission sets (a sleep on an event, never on a timer);
3. ``result = await trio.to_thread.run_sync(executor.run, plan)``: the forward pass runs
   in a worker thread, so the event loop keeps accepting requests and writing SSE while
   numpy/numba compute (the kernels release the GIL);
4. ``finished = scheduler.commit(result)``, then each sampled token goes to its
   request: through its :class:`~triollm.textstream.TextStream` (detokenized, stop
   ids and stop strings applied), and handed over with ``send_nowait``
   on that request's bounded memory channel. ``trio.WouldBlock`` means the client has
   fallen ``stream_buffer_steps`` steps behind: its sequence is cancelled, its blocks
   go back, and its stream ends with a ``too_slow`` error. The loop never awaits a client;
5. signal the admission driver: a step may have freed a slot.

A request's stream ends with exactly one :data:`~triollm.events.Outcome`, set *before*
the channel is closed, so the reader drains the buffered deltas and then reads why it
ended.

The ``n`` choices of one prompt (OpenAI's ``n``, :meth:`Service.submit_choices`) are
``n`` sequences of one scheduler group (its rule 10: admitted together, the prompt's
blocks shared), each with its own sampler and text pipeline, streaming into the
request's *one* channel: every :class:`~triollm.events.Delta` carries its choice's
``index``, and each choice's end is an :class:`~triollm.events.Ended` on the same
channel, after its last delta. One channel, not one per choice, because the reader is
one client: its handler reads one channel in one task (the SSE body is an async
generator, and a nursery of readers cannot be held open across its ``yield``), a
slow client is cut as one, and a client that leaves cancels every choice with one
``close``. The events themselves and the metrics hooks live in ``events.py``; the text
rules in ``textstream.py``; the memory arithmetic in ``sizing.py``.

Cancellation: a client that leaves makes its handler's cancel scope fire; the HTTP
edge then calls :meth:`RequestStream.close` from a ``finally`` block. ``close`` is
synchronous on purpose: inside a cancelled scope every ``await`` raises at once, so
cleanup that awaits would silently not happen. It cancels the sequence in the
scheduler, whose blocks are back in the pool before ``close`` returns.

Trap: every change that could let a waiter in (finish, cancel, step) must call
``self.queue.signal()``; a missed signal is not a crash but a stall.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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
    StepRecorder,
    TokenInfo,
)
from triollm.outcomes import EndCode
from triollm.plan import (
    Finished,
    FinishReason,
    MinTokens,
    PromptScores,
    SampledToken,
    SequenceFailure,
    StepPlan,
    StepResult,
)
from triollm.scheduler import Scheduler
from triollm.spec import SequenceSpec
from triollm.textstream import Detokenizer, TextStream
from triollm.toolcalls import ToolCallParser

__all__ = [
    "Choice",
    "Completed",
    "Delta",
    "Ended",
    "Executor",
    "Failed",
    "Outcome",
    "RequestStream",
    "Service",
    "ServiceConfig",
    "TokenInfo",
]

log = logging.getLogger("triollm.service")

SHUT_DOWN_MESSAGE = "the server shut down before the request finished"


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
    max_tokens_default: int | None = None  # None: the rest of the context

    def __post_init__(self) -> None:
        if self.queue_depth_per_slot < 1:
            raise ValueError(f"queue_depth_per_slot must be >= 1, got {self.queue_depth_per_slot}")
        if not (self.queue_wait_s > 0 and math.isfinite(self.queue_wait_s)):
            raise ValueError(f"queue_wait_s must be a positive number, got {self.queue_wait_s}")
        if self.stream_buffer_steps < 1:
            raise ValueError(f"stream_buffer_steps must be >= 1, got {self.stream_buffer_steps}")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")


class Executor(Protocol):
    """What the batch loop needs from :class:`triollm.batch.Batch` (tests pass a fake)."""

    def add(self, seq_id: int, prompt_ids: Sequence[int], params: Any) -> None: ...
    def remove(self, seq_id: int) -> None: ...
    def run(self, plan: StepPlan) -> StepResult: ...


# --------------------------------------------------------------------------- one request


@dataclass(frozen=True)
class Choice:
    """What differs between the choices of one request: each samples with its own
    ``params`` (the edge gives choice ``i`` the seed ``seed + i``) and parses its own
    tool calls (a parser holds the state of one answer)."""

    params: Any
    tools: ToolCallParser | None = None


Event = Delta | Ended


@dataclass(eq=False)
class _Request:
    """The one channel a request's choices stream into, and who still writes to it.

    Invariant: the buffer never holds more than ``delta_room`` deltas (``_deliver``
    refuses the next one: too slow), and each choice sends one :class:`Ended`, so the
    ``delta_room + n`` places always have room for every choice's end.
    """

    send: trio.MemorySendChannel[Event]
    delta_room: int  # n x stream_buffer_steps: each step gives each choice <= 1 delta
    open: int  # choices with no outcome yet; the channel closes when none is left
    members: list[_Live]
    # A scored prompt (echo with logprobs): position -> its token's TokenInfo, filled
    # from the steps' PromptScores of whichever choice computed that position (they
    # share the prompt), and given to each choice in its first delta.
    prompt_scores: list[TokenInfo | None] | None = None


@dataclass(eq=False)
class _Live:
    """The service's record of one sequence (a request's choice) from enqueue to its
    outcome."""

    seq_id: int
    index: int  # its choice's index in the request
    request: _Request
    prompt_ids: tuple[int, ...]
    params: Any
    text: TextStream
    arrived: float
    want_logprobs: bool
    internal: bool = False  # the warm-up request: not counted in metrics
    admitted_at: float | None = None
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache
    last_token_at: float | None = None
    n_generated: int = 0
    in_batch: bool = False
    outcome: Outcome | None = None
    prompt_sent: bool = False  # a scored prompt: its first delta has carried the scores


class RequestStream:
    """The handler's end of one admitted request: ``async for delta in stream``,
    then :attr:`outcome`. A request of several choices: :meth:`events` gives each
    choice's deltas (``Delta.index``) and each choice's :class:`Ended`, in order.

    Trap: call :meth:`close` in a ``finally`` (the HTTP edge does); a stream
    dropped without it keeps generating until its buffer fills.
    """

    def __init__(
        self, service: Service, request: _Request, recv: trio.MemoryReceiveChannel[Event]
    ) -> None:
        self._service = service
        self._members = tuple(request.members)
        self._recv = recv
        self.seq_ids = tuple(live.seq_id for live in self._members)
        self.seq_id = self.seq_ids[0]
        self.n = len(self._members)
        first = self._members[0]
        self.prompt_tokens = len(first.prompt_ids)
        # `is None`, not `or`: MockClock starts at 0.0, a real admission time.
        admitted = first.arrived if first.admitted_at is None else first.admitted_at
        self.queue_seconds = admitted - first.arrived

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        """The next delta of any choice (the ends are left out: see :meth:`events`)."""
        while True:
            event = await self._receive()
            if event is None:
                raise StopAsyncIteration
            if isinstance(event, Delta):
                return event

    async def events(self) -> AsyncIterator[Event]:
        """Every delta and every choice's :class:`Ended`, in the order they happened;
        it stops once every choice has ended."""
        while (event := await self._receive()) is not None:
            yield event

    async def _receive(self) -> Event | None:
        try:
            return await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None

    @property
    def outcomes(self) -> tuple[Outcome | None, ...]:
        """Each choice's outcome, by index; None while it runs."""
        return tuple(live.outcome for live in self._members)

    @property
    def outcome(self) -> Outcome | None:
        """How the request ended; None while it runs. With several choices: the first
        that failed, else the first choice's (None while any choice runs)."""
        outcomes = self.outcomes
        failed = [o for o in outcomes if isinstance(o, Failed)]
        if failed:
            return failed[0]
        return None if None in outcomes else outcomes[0]

    def close(self, reason: EndCode = EndCode.CLIENT_CLOSED, message: str | None = None) -> bool:
        """End every choice still running now (sync: safe in a cancelled ``finally``);
        their blocks are back in the pool on return. Returns True if this cut any
        short; ``reason`` is recorded (``CLIENT_CLOSED``, ``SHUTDOWN`` when the
        server cut it, or the code of a sibling choice whose failure failed the
        response), with ``message`` if given."""
        self._recv.close()
        cut = [self._service._abandon(live, reason, message) for live in self._members]
        return any(cut)


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
        eos_token_ids: frozenset[int],
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
        self.config = config or ServiceConfig()
        self._detokenizer = detokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.observer: Observer = observer or NullObserver()
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
        # Invariant: _live holds exactly the requests with no outcome yet.
        self._live: dict[int, _Live] = {}
        # Batch membership changes wait for the safe point between steps (the worker
        # thread reads the executor's per-sequence state during a step).
        self._to_add: list[int] = []
        self._to_remove: list[int] = []
        self._work = trio.Event()  # set when an admission may have made a plan non-empty
        self._changed = trio.Event()  # set (and replaced) on every state change, for waiters
        self._frontend_done = trio.Event()
        self.closing = False
        self._drain_ends: float | None = None  # when the shutdown's grace runs out
        self.ready = False
        self.failed: str | None = None  # why the batch loop stopped (then never ready again)
        # (seq_id, how it ended), for tests
        self.outcomes: deque[tuple[int, FinishReason | EndCode]] = deque(maxlen=1024)

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
                self._end_all(EndCode.SHUTDOWN, SHUT_DOWN_MESSAGE)
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

    async def warm_up(self, prompt_ids: Sequence[int], params: Any) -> None:
        """Run one tiny request through the whole path (prefill and decode), so the
        kernels are compiled before /ready says yes; then the service is ready. Not
        counted in the metrics.

        Raises RuntimeError if it does not complete: a server whose first step
        fails must not report itself ready."""
        stream = await self.submit(
            prompt_ids, params=params, max_tokens=2, ignore_eos=True, internal=True
        )
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()
        if not isinstance(stream.outcome, Completed):
            detail = stream.outcome.message if stream.outcome else "no outcome"
            raise RuntimeError(f"the warm-up request failed: {detail}")
        self.ready = not self.closing and self.failed is None

    def begin_shutdown(self, drain_s: float | None = None) -> None:
        """Stop admitting (waiters get 503); running streams continue, for up to
        ``drain_s`` seconds if given (the grace: it sets :meth:`retry_after_s`)."""
        if drain_s is not None and not self.closing:
            self._drain_ends = trio.current_time() + drain_s
        self.closing = True
        self.ready = False
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
        self._end_all(EndCode.SHUTDOWN, SHUT_DOWN_MESSAGE)

    # ------------------------------------------------------------------ requests

    async def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        params: Any,
        tools: ToolCallParser | None = None,
        **options: Any,
    ) -> RequestStream:
        """Queue a request of one choice and wait for its admission; returns its
        stream. ``options``: the keywords of :meth:`submit_choices`."""
        return await self.submit_choices(prompt_ids, [Choice(params, tools)], **options)

    async def submit_choices(
        self,
        prompt_ids: Sequence[int],
        choices: Sequence[Choice],
        *,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        want_logprobs: bool = False,
        internal: bool = False,
        cache_salt: str = "",
        priority: int = 0,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
        score_prompt: bool = False,
    ) -> RequestStream:
        """Queue a request with ``len(choices)`` answers to one prompt (OpenAI's ``n``)
        and wait for their admission, all together; returns their stream.

        The choices are one scheduler group (its rule 10): the prompt's full blocks
        are computed once and shared, each choice has its own answer blocks, sampler
        (``Choice.params``) and text pipeline (stop strings, tool calls), and ends on
        its own: a choice that fails ends alone, like any sequence. ``max_tokens``,
        the stops and the rest are each choice's. Left out, ``max_tokens`` is the
        room every choice can have at once (``Scheduler.room``).

        ``priority`` (smaller is served earlier; vLLM's convention) reaches the
        policy's views. A non-zero one under a policy that does not order by it is
        refused, as vLLM refuses one without priority scheduling: a client that
        asked to go first and silently did not would draw the wrong conclusion.

        ``stop_token_ids`` end the answer like EOS (also with ``ignore_eos``, as in
        vLLM); ``min_tokens`` keeps every stop id and stop string from ending it
        earlier (the ids through :class:`~triollm.plan.MinTokens`, the strings in the
        TextStream); ``include_stop`` keeps a matched stop string in the text.
        ``score_prompt`` (echo with logprobs): each choice's first delta carries every
        prompt token's log-probability (``Delta.prompt``), and ``max_tokens`` may be 0
        (Scheduler rule 11).

        Raises ``QueueFull`` / ``QueueTimeout`` (429; the choices take ``n`` places in
        the queue), ``QueueClosed`` (503), the scheduler's ``Infeasible`` (naming
        ``n`` when the group could never fit) or ``FieldError`` (400); a client that
        leaves while queued gets ``Cancelled`` with nothing left behind.
        """
        n = len(choices)
        if priority != 0 and not self.scheduler.policy.orders_by_priority:
            raise FieldError(
                "priority",
                f"'priority' is {priority}, but this server's scheduling policy "
                f"({self.scheduler.policy.name}) does not order by priority and would "
                "ignore it; leave it out or send 0",
            )
        if max_tokens is None:
            # "The rest of the context" must also fit the pool: with a pool smaller
            # than slots x context, an unset max_tokens would reserve the whole
            # context and every request without max_tokens (the openai chat
            # default) would be refused. Room is counted against what the pool can
            # hold for all the choices at once.
            max_tokens = self.config.max_tokens_default
            room = self.scheduler.room(SequenceSpec(prompt_ids, n=max(n, 1)))
            if room >= 1:  # else: let the scheduler name the limit the prompt breaks
                max_tokens = room if max_tokens is None else min(max_tokens, room)
        stop_ids = (frozenset() if ignore_eos else self.eos_token_ids) | frozenset(stop_token_ids)
        # Everything that can fail is built before enqueue: after it, sequences exist.
        members = []
        for choice in choices:
            params = choice.params
            if min_tokens > 0 and stop_ids:
                params = MinTokens(params, min_tokens, stop_ids)
            text = TextStream(
                self._detokenizer(prompt_ids),
                stops=stop,
                stop_ids=stop_ids,
                tools=choice.tools,
                include_stop=include_stop,
                min_tokens=min_tokens,
            )
            members.append((params, text))
        seq_ids = self.queue.enqueue(
            SequenceSpec(
                prompt_ids,
                max_tokens,
                stop_ids,
                n=n,
                priority=priority,
                cache_salt=cache_salt,
                score_prompt=score_prompt,
            )
        )
        delta_room = n * self.config.stream_buffer_steps
        send, recv = trio.open_memory_channel[Event](delta_room + n)  # and one end each
        request = _Request(send, delta_room, n, [])
        if score_prompt:  # nothing predicts the first token: its logprob is None
            request.prompt_scores = [TokenInfo(prompt_ids[0], None, ())]
            request.prompt_scores += [None] * (len(prompt_ids) - 1)
        now = trio.current_time()
        for index, (seq_id, (params, text)) in enumerate(zip(seq_ids, members, strict=True)):
            live = _Live(
                seq_id=seq_id,
                index=index,
                request=request,
                prompt_ids=tuple(prompt_ids),
                params=params,
                text=text,
                arrived=now,
                want_logprobs=want_logprobs,
                internal=internal,
            )
            request.members.append(live)
            self._live[seq_id] = live
        self.notify()
        try:
            await self.queue.wait_admitted(seq_ids[0])
        except BaseException:
            # Sync cleanup (we may be cancelled). The queue already cancelled every member.
            for seq_id in seq_ids:
                self._live.pop(seq_id, None)
            send.close()
            self.notify()
            raise
        return RequestStream(self, request, recv)

    def _on_admit(self, seq_id: int) -> None:
        live = self._live.get(seq_id)
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
        live = self._live.pop(seq_id, None)
        if live is not None and live.in_batch:
            self._to_remove.append(seq_id)
        self.notify()

    # ------------------------------------------------------------------ ending requests

    def _end(self, live: _Live, outcome: Outcome, *, cancel: bool) -> None:
        """The one place a request ends. Sync; idempotent through ``_live``."""
        if self._live.get(live.seq_id) is not live:
            return
        del self._live[live.seq_id]
        if cancel:
            self.scheduler.cancel(live.seq_id)  # blocks back in the pool now
            # The freed blocks may let a running sequence the pool had starved
            # (free-slot) grow again; a loop parked on an empty plan must look.
            self._work.set()
        live.outcome = outcome  # before the end: the reader drains, then reads this
        self._send_end(live, outcome)
        if live.in_batch:
            self._to_remove.append(live.seq_id)
        ended = outcome.finish_reason if isinstance(outcome, Completed) else outcome.code
        self.outcomes.append((live.seq_id, ended))
        if not live.internal:
            if isinstance(outcome, Completed):
                self.observer.finished(outcome.finish_reason, trio.current_time() - live.arrived)
            else:
                self.observer.ended_early(outcome.code)
        self.queue.signal()
        self.notify()

    def _send_end(self, live: _Live, outcome: Outcome) -> None:
        """Tell the reader this choice has ended; close the channel after the last."""
        request = live.request
        # The reader may have gone (close()): nobody to tell then.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            request.send.send_nowait(Ended(live.index, outcome))  # room: _Request's invariant
        request.open -= 1
        if request.open == 0:
            request.send.close()

    def _failed(self, live: _Live, code: EndCode, message: str) -> Failed:
        return Failed(code, message, len(live.prompt_ids), live.n_generated)

    def _abandon(self, live: _Live, reason: EndCode, message: str | None = None) -> bool:
        if live.outcome is not None or self._live.get(live.seq_id) is not live:
            return False
        if message is None:
            message = (
                SHUT_DOWN_MESSAGE
                if reason is EndCode.SHUTDOWN
                else "the client closed the connection"
            )
        self._end(live, self._failed(live, reason, message), cancel=True)
        return True

    def _end_all(self, code: EndCode, message: str) -> None:
        for live in list(self._live.values()):
            if live.admitted_at is not None:
                self._end(live, self._failed(live, code, message), cancel=True)

    # ------------------------------------------------------------------ the batch loop

    def _apply_membership(self) -> None:
        """The safe point: no step is running, so the executor may change."""
        removes, self._to_remove = self._to_remove, []
        for seq_id in removes:
            self.executor.remove(seq_id)
        adds, self._to_add = self._to_add, []
        for seq_id in adds:
            live = self._live.get(seq_id)
            if live is None or live.outcome is not None:
                continue  # left before it ever ran
            self.executor.add(seq_id, live.prompt_ids, live.params)
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
        self.failed = message
        self.ready = False
        self.queue.close(message)
        for live in list(self._live.values()):
            if live.admitted_at is None:
                continue  # still queued: close() woke it with QueueClosed
            try:
                self._end(live, self._failed(live, EndCode.INTERNAL, message), cancel=True)
            except Exception:  # the failing part may be on this path too
                log.exception("seq %d: ending it failed; closing its stream", live.seq_id)
                self._live.pop(live.seq_id, None)
                live.outcome = self._failed(live, EndCode.INTERNAL, message)
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
                    live = self._live.get(chunk.seq_id)
                    if live is not None:
                        self._end(
                            live,
                            self._failed(live, EndCode.INTERNAL, f"the step failed: {exc}"),
                            cancel=True,
                        )
                    else:
                        self.scheduler.cancel(chunk.seq_id)
                continue
            finished = {f.seq_id: f for f in self.scheduler.commit(result)}
            rec = self.recorder.record(plan, result)
            if not self._only_internal(plan):  # the warm-up's steps stay out of the metrics
                self.observer.step(rec.rows, rec.width)
            self._record_scores(result.scores)
            self._dispatch(result.sampled, finished)
            self._fail_sequences(result.failed)
            self.queue.signal()  # a step may have freed a slot (and a signal is cheap)
            self.notify()
            await trio.lowlevel.checkpoint()  # let handlers write before the next step

    async def run_in_thread(self, plan: StepPlan) -> StepResult:
        # Not abandon_on_cancel: the thread writes the KV pool; shutdown waits for the step.
        return await trio.to_thread.run_sync(self.executor.run, plan)

    def _fail_sequences(self, failures: Sequence[SequenceFailure]) -> None:
        """Sequences the Batch could not sample (their grammar failed): each ends
        alone, with an error event; the scheduler did not advance them."""
        for failure in failures:
            log.warning("seq %d: %s", failure.seq_id, failure.message)
            live = self._live.get(failure.seq_id)
            if live is not None:
                self._end(
                    live, self._failed(live, EndCode.GRAMMAR_FAILED, failure.message), cancel=True
                )
            else:
                self.scheduler.cancel(failure.seq_id)

    def _record_scores(self, scores: Sequence[PromptScores]) -> None:
        """Keep each scored chunk's log-probabilities by position (a prompt scored
        again after a preemption overwrites them) until the first deltas take them."""
        for chunk in scores:
            live = self._live.get(chunk.seq_id)
            if live is None or live.request.prompt_scores is None:
                continue  # cancelled while the step ran
            kept, ids = live.request.prompt_scores, live.prompt_ids
            for i, (lp, top) in enumerate(zip(chunk.logprobs, chunk.top, strict=True)):
                kept[chunk.first + i] = TokenInfo(ids[chunk.first + i], lp, top)

    def _prompt_infos(self, live: _Live) -> tuple[TokenInfo, ...]:
        """The scored prompt, for a choice's first delta; () for every other delta.

        Raises RuntimeError if a position was never scored (a bug: the scheduler
        computes every position of a scored prompt); the caller ends that request
        alone, as when its text pipeline fails."""
        scores = live.request.prompt_scores
        if scores is None or live.prompt_sent:
            return ()
        live.prompt_sent = True
        missing = [p for p, info in enumerate(scores) if info is None]
        if missing:
            raise RuntimeError(
                f"{len(missing)} prompt position(s) were not scored (from {missing[0]})"
            )
        return tuple(info for info in scores if info is not None)

    def _dispatch(self, sampled: Sequence[SampledToken], finished: dict[int, Finished]) -> None:
        now = trio.current_time()
        for tok in sampled:
            live = self._live.get(tok.seq_id)
            if live is None:
                continue  # cancelled while the step ran: commit ignored it too
            self._deliver(live, tok, finished.get(tok.seq_id), now)
        for seq_id, fin in finished.items():
            live = self._live.get(seq_id)
            if live is not None:  # finished without a token: a scored prompt, max_tokens 0
                try:
                    prompt = self._prompt_infos(live)
                except RuntimeError as exc:
                    self._text_failed(live, exc)
                    continue
                self._complete(live, fin.reason, Delta("", (), prompt=prompt))

    def _deliver(self, live: _Live, tok: SampledToken, fin: Finished | None, now: float) -> None:
        first = live.last_token_at is None
        # First token: time since arrival (TTFT). Later: time since the previous token.
        since = now - (live.arrived if live.last_token_at is None else live.last_token_at)
        live.last_token_at = now
        live.n_generated += 1
        if not live.internal:
            self.observer.token(first, since)
        info = (
            (TokenInfo(tok.token_id, tok.logprob, tok.top_logprobs),) if live.want_logprobs else ()
        )
        try:
            prompt = self._prompt_infos(live)  # () but in a scored prompt's first delta
            piece = live.text.push(tok.token_id)
        except Exception as exc:
            self._text_failed(live, exc)
            return
        if piece.finish is not None:  # a stop id or a stop string ended the text
            if fin is None:  # a stop string: the scheduler does not know yet
                self.scheduler.finish(live.seq_id, FinishReason.STOP)
            self._complete(
                live, piece.finish, Delta(piece.text, info, piece.tool_calls, prompt=prompt)
            )
            return
        text = piece.text
        if fin is not None:  # the scheduler ended it (length, or a complete grammar)
            try:
                end = live.text.finish(fin.reason)
            except Exception as exc:
                self._text_failed(live, exc)
                return
            assert end.finish is not None
            calls = piece.tool_calls + end.tool_calls
            self._complete(live, end.finish, Delta(text + end.text, info, calls, prompt=prompt))
            return
        if not text and not info and not piece.tool_calls and not prompt:
            return  # held back: nothing to say yet
        request = live.request
        if request.send.statistics().current_buffer_used >= request.delta_room:
            self._too_slow(live)
            return
        request.send.send_nowait(Delta(text, info, piece.tool_calls, live.index, prompt))

    def _text_failed(self, live: _Live, exc: Exception) -> None:
        """One request's text pipeline (its detokenizer, its stop matcher) raised: that
        request's state is broken, the loop's is not. It ends alone, its blocks back;
        the rest of the step is delivered as usual (tests/server/test_faults.py)."""
        log.exception("seq %d: turning its tokens into text failed", live.seq_id)
        message = f"turning tokens into text failed: {type(exc).__name__}: {exc}"
        self._end(live, self._failed(live, EndCode.INTERNAL, message), cancel=True)

    def _complete(self, live: _Live, reason: FinishReason, final: Delta) -> None:
        final = dataclasses.replace(final, index=live.index)
        outcome = Completed(
            reason, final, len(live.prompt_ids), live.n_generated, live.cached_tokens
        )
        # The scheduler has ended it already (commit or finish): no cancel.
        self._end(live, outcome, cancel=False)

    def _too_slow(self, live: _Live) -> None:
        """The client has not read its stream for ``stream_buffer_steps`` steps: every
        choice of its request ends (one client reads them all)."""
        n = self.config.stream_buffer_steps
        log.warning("seq %d: client %d steps behind (buffer full); cancelling it", live.seq_id, n)
        message = (
            f"the client fell {n} steps behind the generation (its stream buffer is full);"
            " the request was cancelled to free its slot"
        )
        for member in live.request.members:
            self._end(member, self._failed(member, EndCode.TOO_SLOW, message), cancel=True)

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
        lives = [self._live.get(c.seq_id) for c in plan.chunks]
        return all(live is not None and live.internal for live in lives)

    @property
    def internal_running(self) -> int:
        """Internal requests (the warm-up) holding a slot: hidden from the gauges."""
        return sum(
            1 for live in self._live.values() if live.internal and live.admitted_at is not None
        )

    @property
    def live_requests(self) -> int:
        return len(self._live)
