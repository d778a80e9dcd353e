"""The output processor: from each step's sampled tokens to each request's stream.

The service's batch loop (``service.py``) runs steps; this module owns what happens to
a step's result per request, vLLM v1's ``OutputProcessor``:

- the **request streams**: one bounded memory channel per request, its reader's end a
  :class:`RequestStream`; the ``n`` choices of one request share it (every
  :class:`~triollm.events.Delta` names its choice's ``index``, each choice's end is an
  :class:`~triollm.events.Ended` after its last delta). One channel, not one per
  choice, because the reader is one client: its handler reads one channel in one task,
  a slow client is cut as one, and a client that leaves cancels every choice with one
  ``close``;
- the **text pipeline** per choice: a :class:`~triollm.textstream.TextStream`
  (detokenized, stop ids and stop strings applied, tool calls parsed);
- **dispatch** (:meth:`OutputProcessor.dispatch`): each sampled token through its
  choice's pipeline, handed over with ``send_nowait``. A full buffer means the client
  has fallen ``stream_buffer_steps`` steps behind: every choice of that request ends
  with ``too_slow``. The batch loop never awaits a client;
- **prompt scores** (echo with logprobs): the steps' ``PromptScores`` kept by position
  and given to each choice in its first delta;
- the **token texts** (:class:`Describer`): a request that asked for logprobs gets
  each token's own text and bytes, and a scored prompt's text offsets, filled into
  its deltas on the reader's side (in a worker thread for a whole prompt), so the
  edge shapes JSON without ever holding a tokenizer;
- the **outcomes**: a choice's stream ends with exactly one
  :data:`~triollm.events.Outcome`, set *before* its ``Ended`` is sent, so the reader
  drains the buffered deltas and then reads why it ended.

What it does not own: the scheduler, the Batch and the admission queue. When a choice
ends, :meth:`OutputProcessor.end` records the outcome and tells the service through
one callback (``retire``), which cancels the sequence in the scheduler if asked,
schedules its removal from the Batch and signals the queue.

Read with ``events.py`` (the frozen values sent) and ``service.py`` (the loop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from triollm.events import Completed, Delta, Ended, Failed, Observer, Outcome, TokenInfo
from triollm.outcomes import EndCode
from triollm.plan import Finished, FinishReason, PromptScores, SampledToken
from triollm.spec import GenerationSpec
from triollm.textstream import Detokenizer, TextStream
from triollm.toolcalls import ToolCallParser

__all__ = [
    "SHUT_DOWN_MESSAGE",
    "Choice",
    "Describer",
    "Event",
    "OutputProcessor",
    "RequestStream",
    "TokenTexts",
    "token_text",
]

log = logging.getLogger("triollm.service")

SHUT_DOWN_MESSAGE = "the server shut down before the request finished"

Event = Delta | Ended


# --------------------------------------------------------------------------- token texts


class TokenTexts(Protocol):
    """What :func:`token_text` asks of a tokenizer (``model/tokenizer.Tokenizer``)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...
    def token_bytes(self, token_id: int) -> bytes | None: ...


def token_text(tokenizer: TokenTexts, token_id: int) -> tuple[str, bytes]:
    """(how the token shows on its own, its own bytes), for a logprobs entry.

    A token that is part of a UTF-8 character decodes to U+FFFD on its own, so every
    such byte token would show (and, as a ``top_logprobs`` key, collide) as the same
    "\ufffd". Those are shown as ``bytes:\\xNN`` (OpenAI's spelling) with their real
    bytes (``Tokenizer.token_bytes``)."""
    text = str(tokenizer.decode([token_id], skip_special_tokens=False))
    if "\ufffd" not in text:
        return text, text.encode()
    raw = tokenizer.token_bytes(token_id)
    if raw is None:
        return text, text.encode()
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class Describer:
    """Fills a delta's token texts (:func:`token_text`) and a scored prompt's offsets:
    where each prompt token's text starts, the prompt streamed through the same
    incremental detokenizer an answer goes through, so the offsets follow one rule."""

    def __init__(
        self, tokenizer: TokenTexts, detokenizer: Callable[[Sequence[int]], Detokenizer]
    ) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = detokenizer

    def delta(self, delta: Delta) -> Delta:
        tokens = tuple(self._info(t) for t in delta.tokens)
        if not delta.prompt:
            return dataclasses.replace(delta, tokens=tokens)
        prompt = tuple(self._info(t) for t in delta.prompt)
        detok = self._detokenizer(())
        offsets, at = [], 0
        for t in delta.prompt:
            offsets.append(at)
            at += len(detok.push(t.token_id))
        return dataclasses.replace(
            delta, tokens=tokens, prompt=prompt, prompt_offsets=tuple(offsets)
        )

    def _info(self, t: TokenInfo) -> TokenInfo:
        text, raw = token_text(self._tokenizer, t.token_id)
        alts = tuple(token_text(self._tokenizer, i) for i, _ in t.top)
        return dataclasses.replace(t, text=text, raw=raw, top_text=alts)


# --------------------------------------------------------------------------- one request


@dataclass(eq=False)
class _Request:
    """One request's channel, its spec, and which of its choices still write to it.

    Invariant: the buffer never holds more than ``delta_room`` deltas (``_deliver``
    refuses the next one: too slow), and each choice sends one :class:`Ended`, so the
    ``delta_room + n`` places always have room for every choice's end.
    """

    spec: GenerationSpec
    send: trio.MemorySendChannel[Event]
    delta_room: int  # n x stream_buffer_steps: each step gives each choice <= 1 delta
    open: int  # choices with no outcome yet; the channel closes when none is left
    members: list[Choice]
    # Its first choice's index in the response: a list of prompts is one response,
    # prompt i's choice j its ``base + j`` (OpenAI's ``i * n + j``), on one channel.
    base: int = 0
    # A scored prompt (echo with logprobs): position -> its token's TokenInfo, filled
    # from the steps' PromptScores of whichever choice computed that position (they
    # share the prompt), and given to each choice in its first delta.
    prompt_scores: list[TokenInfo | None] | None = None


@dataclass(eq=False)
class Choice:
    """One choice of a request (one scheduler sequence) from enqueue to its outcome."""

    seq_id: int
    index: int  # its index among the request's choices (OpenAI's ``index``)
    request: _Request
    text: TextStream
    arrived: float
    admitted_at: float | None = None
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache
    last_token_at: float | None = None
    n_generated: int = 0
    in_batch: bool = False
    outcome: Outcome | None = None
    prompt_sent: bool = False  # a scored prompt: its first delta has carried the scores

    @property
    def spec(self) -> GenerationSpec:
        return self.request.spec

    @property
    def wire(self) -> int:
        """Its index in the response (``index`` is its index among its prompt's choices:
        its seed's offset)."""
        return self.request.base + self.index

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.spec.prompt_ids

    @property
    def internal(self) -> bool:
        """The warm-up request: not counted in metrics."""
        return self.request.spec.internal


class Pending:
    """A request built before it is queued (its text pipelines, its channel), so that
    nothing can fail once its sequences exist in the scheduler."""

    def __init__(
        self,
        request: _Request,
        recv: trio.MemoryReceiveChannel[Event],
        requests: Sequence[_Request] = (),
    ) -> None:
        self.request = request
        self.recv = recv
        # A list of prompts: one request per prompt, all on ``recv`` (the first is
        # ``request``).
        self.requests = tuple(requests) or (request,)


class RequestStream:
    """The handler's end of one admitted request: ``async for delta in stream``,
    then :attr:`outcome`. A request of several choices: :meth:`events` gives each
    choice's deltas (``Delta.index``) and each choice's :class:`Ended`, in order.

    Trap: call :meth:`close` in a ``finally`` (the HTTP edge does); a stream
    dropped without it keeps generating until its buffer fills.
    """

    def __init__(self, output: OutputProcessor, pending: Pending) -> None:
        self._output = output
        # Only a request that asked for logprobs (or a scored prompt's) needs its
        # tokens' texts.
        spec = pending.request.spec
        self._describer = output.describer if spec.want_logprobs or spec.score_prompt else None
        self._members = tuple(c for r in pending.requests for c in r.members)
        self._recv = pending.recv
        self.spec = pending.request.spec
        self.seq_ids = tuple(c.seq_id for c in self._members)
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
            event = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        if self._describer is None:
            return event
        if isinstance(event, Delta):
            return await self._describe(event)
        outcome = event.outcome
        if isinstance(outcome, Completed):
            final = await self._describe(outcome.final)
            return Ended(event.index, dataclasses.replace(outcome, final=final))
        return event

    async def _describe(self, delta: Delta) -> Delta:
        """The delta with its tokens' texts; a scored prompt's in a worker thread, since
        a few tokenizer calls per prompt token would stall every other stream."""
        assert self._describer is not None
        if not delta.prompt:
            return self._describer.delta(delta)
        return await trio.to_thread.run_sync(self._describer.delta, delta)

    @property
    def outcomes(self) -> tuple[Outcome | None, ...]:
        """Each choice's outcome, by index; None while it runs."""
        return tuple(c.outcome for c in self._members)

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
        cut = [self._output.abandon(c, reason, message) for c in self._members]
        return any(cut)


class OutputProcessor:
    """The per-request output half of the service (see the module docstring).

    ``detokenizer(prompt_ids)`` starts a choice's incremental detokenizer;
    ``stream_buffer_steps`` bounds how far a reader may fall behind; ``observer``
    gets the token and end hooks; ``retire(choice, cancel)`` is the service's part of
    an end (the scheduler, the Batch, the queue); ``stop(seq_id)`` ends a sequence in
    the scheduler when a stop string (which only the text knows) ended its text;
    ``token_texts`` (the tokenizer) gives the logprobs entries their texts.
    """

    def __init__(
        self,
        *,
        detokenizer: Callable[[Sequence[int]], Detokenizer],
        stream_buffer_steps: int,
        observer: Observer,
        retire: Callable[[Choice, bool], None],
        stop: Callable[[int], None],
        token_texts: TokenTexts | None = None,
    ) -> None:
        self._detokenizer = detokenizer
        # None (a test's fake model): the deltas' token texts stay empty.
        self.describer = None if token_texts is None else Describer(token_texts, detokenizer)
        self.stream_buffer_steps = stream_buffer_steps
        self.observer = observer
        self._retire = retire
        self._stop = stop
        # Invariant: live holds exactly the choices with no outcome yet.
        self.live: dict[int, Choice] = {}
        # (seq_id, how it ended), for tests and tools
        self.outcomes: deque[tuple[int, FinishReason | EndCode]] = deque(maxlen=1024)

    # ------------------------------------------------------------------ opening

    def pending(self, spec: GenerationSpec) -> Pending:
        """Build a request's text pipelines and channel (this may raise: a tool-call
        format or a detokenizer refusing); nothing is tracked yet."""
        n = spec.n
        delta_room = n * self.stream_buffer_steps
        send, recv = trio.open_memory_channel[Event](delta_room + n)  # and one end each
        return Pending(self._request(spec, send, delta_room), recv)

    def pending_prompts(self, specs: Sequence[GenerationSpec]) -> Pending:
        """:meth:`pending` for a list of prompts (``/v1/completions``): one request per
        prompt, each of its ``n`` choices, all writing to one channel (each its own
        clone of the sending end, closed when its last choice ends) with the response's
        indices (``_Request.base``). The buffer is shared: ``delta_room`` is every
        choice's, so the invariant (room for every end) holds across them."""
        total = sum(spec.n for spec in specs)
        delta_room = total * self.stream_buffer_steps
        send, recv = trio.open_memory_channel[Event](delta_room + total)
        requests, base = [], 0
        with send:
            for spec in specs:
                requests.append(self._request(spec, send.clone(), delta_room, base))
                base += spec.n
        return Pending(requests[0], recv, requests)

    def _request(
        self, spec: GenerationSpec, send: trio.MemorySendChannel[Event], room: int, base: int = 0
    ) -> _Request:
        n = spec.n
        request = _Request(spec, send, room, n, [], base)
        if spec.score_prompt:  # nothing predicts the first token: its logprob is None
            request.prompt_scores = [TokenInfo(spec.prompt_ids[0], None, ())]
            request.prompt_scores += [None] * (len(spec.prompt_ids) - 1)
        texts = [
            TextStream(
                self._detokenizer(spec.prompt_ids),
                stops=spec.stop,
                stop_ids=spec.stop_token_ids,
                tools=None if spec.tool_format is None else ToolCallParser(spec.tool_format),
                include_stop=spec.include_stop,
                min_tokens=spec.min_tokens,
                skip_special=spec.skip_special_tokens,
            )
            for _ in range(n)
        ]
        request.members = [Choice(-1, i, request, text, 0.0) for i, text in enumerate(texts)]
        return request

    def track(self, pending: Pending, seq_ids: Sequence[int], which: int = 0) -> None:
        """The request's sequences exist (queued): track each choice under its id
        (``which``: the prompt, of a list of prompts)."""
        now = trio.current_time()
        for choice, seq_id in zip(pending.requests[which].members, seq_ids, strict=True):
            choice.seq_id = seq_id
            choice.arrived = now
            self.live[seq_id] = choice

    def untrack(self, pending: Pending) -> None:
        """The request never got its slots (refused, timed out, client gone): forget it."""
        for request in pending.requests:
            for choice in request.members:
                self.live.pop(choice.seq_id, None)
            request.send.close()

    def stream(self, pending: Pending) -> RequestStream:
        return RequestStream(self, pending)

    # ------------------------------------------------------------------ ending

    def end(self, choice: Choice, outcome: Outcome, *, cancel: bool) -> None:
        """The one place a choice ends. Sync; idempotent through ``live``."""
        if self.live.get(choice.seq_id) is not choice:
            return
        del self.live[choice.seq_id]
        choice.outcome = outcome  # before the end: the reader drains, then reads this
        self._retire(choice, cancel)  # the scheduler's blocks back now (if cancel)
        self._send_end(choice, outcome)
        ended = outcome.finish_reason if isinstance(outcome, Completed) else outcome.code
        self.outcomes.append((choice.seq_id, ended))
        if not choice.internal:
            if isinstance(outcome, Completed):
                self.observer.finished(outcome.finish_reason, trio.current_time() - choice.arrived)
            else:
                self.observer.ended_early(outcome.code)

    def _send_end(self, choice: Choice, outcome: Outcome) -> None:
        """Tell the reader this choice has ended; close the channel after the last."""
        request = choice.request
        # The reader may have gone (close()): nobody to tell then.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            request.send.send_nowait(Ended(choice.wire, outcome))  # room: _Request's invariant
        request.open -= 1
        if request.open == 0:
            request.send.close()

    def failed(self, choice: Choice, code: EndCode, message: str) -> Failed:
        return Failed(code, message, len(choice.prompt_ids), choice.n_generated)

    def fail(self, choice: Choice, code: EndCode, message: str) -> None:
        """End ``choice`` with an error event; its sequence is cancelled."""
        self.end(choice, self.failed(choice, code, message), cancel=True)

    def abandon(self, choice: Choice, reason: EndCode, message: str | None = None) -> bool:
        if choice.outcome is not None or self.live.get(choice.seq_id) is not choice:
            return False
        if message is None:
            message = (
                SHUT_DOWN_MESSAGE
                if reason is EndCode.SHUTDOWN
                else "the client closed the connection"
            )
        self.fail(choice, reason, message)
        return True

    def end_admitted(self, code: EndCode, message: str) -> None:
        """End every admitted choice with ``code`` (shutdown, or a failed loop)."""
        for choice in list(self.live.values()):
            if choice.admitted_at is not None:
                self.fail(choice, code, message)

    # ------------------------------------------------------------------ one step's output

    def record_scores(self, scores: Sequence[PromptScores]) -> None:
        """Keep each scored chunk's log-probabilities by position (a prompt scored
        again after a preemption overwrites them) until the first deltas take them."""
        for chunk in scores:
            choice = self.live.get(chunk.seq_id)
            if choice is None or choice.request.prompt_scores is None:
                continue  # cancelled while the step ran
            kept, ids = choice.request.prompt_scores, choice.prompt_ids
            ranks = chunk.ranks or (None,) * len(chunk.logprobs)
            for i, (lp, top, rank) in enumerate(zip(chunk.logprobs, chunk.top, ranks, strict=True)):
                kept[chunk.first + i] = TokenInfo(ids[chunk.first + i], lp, top, rank=rank)

    def _prompt_infos(self, choice: Choice) -> tuple[TokenInfo, ...]:
        """The scored prompt, for a choice's first delta; () for every other delta.

        Raises RuntimeError if a position was never scored (a bug: the scheduler
        computes every position of a scored prompt); the caller ends that request
        alone, as when its text pipeline fails."""
        scores = choice.request.prompt_scores
        if scores is None or choice.prompt_sent:
            return ()
        choice.prompt_sent = True
        missing = [p for p, info in enumerate(scores) if info is None]
        if missing:
            raise RuntimeError(
                f"{len(missing)} prompt position(s) were not scored (from {missing[0]})"
            )
        return tuple(info for info in scores if info is not None)

    def dispatch(self, sampled: Sequence[SampledToken], finished: dict[int, Finished]) -> None:
        """Deliver one step's tokens, and end the choices the scheduler finished."""
        now = trio.current_time()
        for tok in sampled:
            choice = self.live.get(tok.seq_id)
            if choice is None:
                continue  # cancelled while the step ran: commit ignored it too
            self._deliver(choice, tok, finished.get(tok.seq_id), now)
        for seq_id, fin in finished.items():
            choice = self.live.get(seq_id)
            if choice is not None:  # finished without a token: a scored prompt, max_tokens 0
                try:
                    prompt = self._prompt_infos(choice)
                except RuntimeError as exc:
                    self._text_failed(choice, exc)
                    continue
                self._complete(choice, fin.reason, Delta("", (), prompt=prompt))

    def _deliver(self, choice: Choice, tok: SampledToken, fin: Finished | None, now: float) -> None:
        first = choice.last_token_at is None
        # First token: time since arrival (TTFT). Later: time since the previous token.
        since = now - (choice.arrived if choice.last_token_at is None else choice.last_token_at)
        choice.last_token_at = now
        choice.n_generated += 1
        if not choice.internal:
            self.observer.token(first, since)
        info = (
            (TokenInfo(tok.token_id, tok.logprob, tok.top_logprobs),)
            if choice.spec.want_logprobs
            else ()
        )
        try:
            prompt = self._prompt_infos(choice)  # () but in a scored prompt's first delta
            piece = choice.text.push(tok.token_id)
        except Exception as exc:
            self._text_failed(choice, exc)
            return
        if piece.finish is not None:  # a stop id or a stop string ended the text
            if fin is None:  # a stop string: the scheduler does not know yet
                self._stop(choice.seq_id)
            self._complete(
                choice, piece.finish, Delta(piece.text, info, piece.tool_calls, prompt=prompt)
            )
            return
        text = piece.text
        if fin is not None:  # the scheduler ended it (length, or a complete grammar)
            try:
                end = choice.text.finish(fin.reason)
            except Exception as exc:
                self._text_failed(choice, exc)
                return
            assert end.finish is not None
            calls = piece.tool_calls + end.tool_calls
            self._complete(choice, end.finish, Delta(text + end.text, info, calls, prompt=prompt))
            return
        if not text and not info and not piece.tool_calls and not prompt:
            return  # held back: nothing to say yet
        request = choice.request
        if request.send.statistics().current_buffer_used >= request.delta_room:
            self._too_slow(choice)
            return
        request.send.send_nowait(Delta(text, info, piece.tool_calls, choice.wire, prompt))

    def _text_failed(self, choice: Choice, exc: Exception) -> None:
        """One request's text pipeline (its detokenizer, its stop matcher) raised: that
        request's state is broken, the loop's is not. It ends alone, its blocks back;
        the rest of the step is delivered as usual (tests/server/test_faults.py)."""
        log.exception("seq %d: turning its tokens into text failed", choice.seq_id)
        message = f"turning tokens into text failed: {type(exc).__name__}: {exc}"
        self.fail(choice, EndCode.INTERNAL, message)

    def _complete(self, choice: Choice, reason: FinishReason, final: Delta) -> None:
        final = dataclasses.replace(final, index=choice.wire)
        outcome = Completed(
            reason, final, len(choice.prompt_ids), choice.n_generated, choice.cached_tokens
        )
        # The scheduler has ended it already (commit or finish): no cancel.
        self.end(choice, outcome, cancel=False)

    def _too_slow(self, choice: Choice) -> None:
        """The client has not read its stream for ``stream_buffer_steps`` steps: every
        choice of its request ends (one client reads them all)."""
        n = self.stream_buffer_steps
        log.warning("seq %d: client %d steps behind (buffer full); cancelling it", choice.seq_id, n)
        message = (
            f"the client fell {n} steps behind the generation (its stream buffer is full);"
            " the request was cancelled to free its slot"
        )
        for member in choice.request.members:
            self.fail(member, EndCode.TOO_SLOW, message)
