"""A trace of chosen requests, step by step: what ``triollm trace`` prints.

vLLM's V1 write-ups explain scheduling by printing, per step, which requests ran how
many tokens. This does the same for triollm, and adds what a paged cache makes worth
seeing: each step's rows, the blocks a traced request took, freed and shares with
another, and the token it got.

A :class:`Tracer` *is* the service's :class:`~triollm.events.StepRecorder`: the batch
loop already hands every committed step's plan and result to its recorder
(``Service._run_steps``), so tracing adds no hook to the loop. It reads that plan and
result, and the scheduler's public snapshots (``Scheduler.sequence``,
``BlockPool.refcount``) right after the commit. It is pure: the clock is handed in.

Read with ``mechanisms/trace.py`` (the command: a real server, and each SSE event's
arrival time at a client socket) and docs/architecture.md (a transcript).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from triollm.events import StepRecord, StepRecorder
from triollm.plan import ChunkPlan, StepPlan, StepResult
from triollm.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One line of a trace: seconds since the trace began, and what happened."""

    at: float
    text: str


def blocks_text(blocks: Sequence[int]) -> str:
    return "[" + " ".join(str(b) for b in blocks) + "]"


class Tracer(StepRecorder):
    """A step recorder that also writes one line per step about the traced requests.

    Sequences take the names in ``names`` in the order they first appear in a plan
    (the command admits its requests one at a time, so A is the first one it sent);
    rows of sequences beyond those are counted, not named.

    Trap: blocks are read *after* the commit, so a sequence's admission shows as the
    blocks it took on its first step (under ``reserve`` all of them, prompt and
    answer), and a finished sequence's blocks as freed on the step that finished it.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        clock: Callable[[], float],
        token_text: Callable[[int], str],
        names: Sequence[str] = ("A", "B"),
        capacity: int = 4096,
    ) -> None:
        super().__init__(capacity)
        self._scheduler = scheduler
        self._clock = clock
        self._token_text = token_text
        self._unused = list(names)
        self.name_of: dict[int, str] = {}
        # Invariant: a traced sequence that is still live -> its table at the last record.
        self._held: dict[int, tuple[int, ...]] = {}
        self.start = clock()
        self.lines: list[TraceLine] = []

    def now(self) -> float:
        return self._clock() - self.start

    def note(self, text: str) -> None:
        """A line from outside the batch loop (the command's requests and SSE events)."""
        self.lines.append(TraceLine(self.now(), text))

    def record(self, plan: StepPlan, result: StepResult) -> StepRecord:
        rec = super().record(plan, result)
        for chunk in plan.chunks:
            if chunk.seq_id not in self.name_of and self._unused:
                self.name_of[chunk.seq_id] = self._unused.pop(0)
        chunks = {c.seq_id: c for c in plan.chunks}
        tokens = {t.seq_id: t.token_id for t in result.sampled}
        parts = [
            self._part(seq_id, name, chunks.get(seq_id), tokens.get(seq_id))
            for seq_id, name in self.name_of.items()
        ]
        parts = [p for p in parts if p]
        others = sum(c.n_rows for c in plan.chunks if c.seq_id not in self.name_of)
        if others:
            parts.append(f"{others} untraced row(s)")
        if parts:
            head = f"step {plan.step:>3} {plan.n_rows:>4} rows"
            self.lines.append(TraceLine(self.now(), f"{head} | " + " | ".join(parts)))
        return rec

    def _part(self, seq_id: int, name: str, chunk: ChunkPlan | None, token: int | None) -> str:
        """What one traced sequence did this step; "" when it did nothing."""
        before = self._held.get(seq_id)
        if before is None and chunk is None:
            return ""  # gone before this step, or not running yet
        try:
            now = self._scheduler.sequence(seq_id).blocks
        except KeyError:
            now = ()  # finished or cancelled: every block it held is back
        held = before or ()
        taken = [b for b in now if b not in held]
        freed = [b for b in held if b not in now]
        if chunk is None:
            what = f"{name} -"
        elif chunk.prefill:
            what = f"{name} prefill {chunk.start}-{chunk.start + chunk.n_rows - 1}"
        else:
            what = f"{name} decode {chunk.start}"
        if token is not None:
            what += f" -> {self._token_text(token)!r}"
        notes = []
        if taken:
            shared = [b for b in now if self._scheduler.pool.refcount(b) > 1]
            notes.append(f"takes {blocks_text(taken)}")
            if shared:
                notes.append(f"shares {blocks_text(shared)}")
        if freed:
            # A block another table still names is not back in the pool: say so.
            kept = [b for b in freed if self._scheduler.pool.refcount(b) > 0]
            back = [b for b in freed if b not in kept]
            done = "done, " if not now else ""
            notes.append(f"{done}frees {blocks_text(back)}" if back else f"{done}frees none")
            if kept:
                notes.append(f"{blocks_text(kept)} still held by another")
        if now:
            self._held[seq_id] = now
        else:
            self._held.pop(seq_id, None)
        return what + (", " + ", ".join(notes) if notes else "")
