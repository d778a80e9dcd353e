"""A hypothesis state machine that drives the real Scheduler with arbitrary events.

Rules are the verbs of the batch loop's world: requests ``arrive``, the queue
``admits``, the batch ``steps`` (its results end sequences at random with a stop
token, or at max_tokens), clients ``cancel`` and stop strings ``finish`` a
sequence early. A small model beside the Scheduler remembers what it promised;
the invariants are claims checked after every rule. docs/scheduling.md derives
the liveness bound checked here.
"""

from __future__ import annotations

from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from triollm.kv import blocks_for
from triollm.plan import SampledToken, StepResult
from triollm.scheduler import (
    RUNNING_STATES,
    Infeasible,
    Policy,
    Scheduler,
    SchedulerConfig,
    SeqState,
)

STOP = 0  # the stop token id every request is given; other tokens are 1..9


def liveness_bound(s: Scheduler, seq_id: int) -> int:
    """Steps within which running sequence ``seq_id`` must end, counted from now.

    q = min(chunk, rows - slots + 1) is the least a prefill chunk gets while it is
    the first prefill in admission order (rule 4: at most slots - 1 left-out decoders
    go before it). Every prefilling sequence admitted before this one finishes its
    prompt first, each within ceil(remaining / q) steps; then this one's does. After
    that each answer token needs at most two steps (left out once, first next time).
    """
    cfg = s.config
    q = min(cfg.chunk_tokens, cfg.step_rows - cfg.slots + 1)
    me = s.sequence(seq_id)
    if me.state is SeqState.DECODING:
        return 2 * (me.max_tokens - me.n_generated)
    steps = 0
    for other in s.running_ids():
        info = s.sequence(other)
        if info.state is SeqState.PREFILLING:
            steps += -(-(len(s.token_ids(other)) - info.n_computed) // q)
        if other == seq_id:
            break
    return steps + 2 * (me.max_tokens - me.n_generated - 1)


class SchedulerMachine(RuleBasedStateMachine):
    POLICY = Policy.RESERVE
    CHECK_LIVENESS = True  # the free-slot machine turns this off (or expects it to fail)
    ENDS_EARLY = True  # cancel / finish rules; the deadlock search drops them (they only unblock)

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler
        self.issued: list[int] = []
        self.ended: set[int] = set()
        self.passed: dict[int, int] = {}  # model: times each head was overtaken
        self.deadline: dict[int, int] = {}  # seq_id -> step by which it must have ended

    @initialize(
        block_size=st.integers(1, 6),
        num_blocks=st.integers(2, 24),
        slots=st.integers(1, 4),
        chunk=st.integers(1, 12),
        extra_rows=st.integers(0, 12),
        context=st.integers(4, 48),
        overtake=st.integers(0, 4),
        watermark=st.integers(0, 2),
    )
    def configure(
        self,
        block_size: int,
        num_blocks: int,
        slots: int,
        chunk: int,
        extra_rows: int,
        context: int,
        overtake: int,
        watermark: int,
    ) -> None:
        cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            slots=slots,
            chunk_tokens=chunk,
            step_rows=slots + extra_rows,
            context_tokens=context,
            policy=self.POLICY,
            overtake_limit=min(overtake, slots),
            preempt_watermark_blocks=watermark,
        )
        note(f"config: {cfg}")
        self.s = Scheduler(cfg)

    # -- rules ----------------------------------------------------------------------

    @rule(prompt=st.integers(0, 40), max_tokens=st.none() | st.integers(0, 40))
    def arrive(self, prompt: int, max_tokens: int | None) -> None:
        reason = self.s.feasible(prompt, max_tokens)
        try:
            seq = self.s.add([1 + i % 9 for i in range(prompt)], max_tokens, frozenset({STOP}))
        except Infeasible as exc:
            note(f"arrive prompt={prompt} max_tokens={max_tokens}: refused ({exc.field}: {exc})")
            assert reason == str(exc)
            assert exc.field in ("prompt", "max_tokens")
            return
        assert reason is None
        note(f"arrive prompt={prompt} max_tokens={max_tokens}: seq {seq}")
        self.issued.append(seq)

    @rule(data=st.data(), n=st.integers(1, 3))
    def arrive_fitting(self, data: st.DataObject, n: int) -> None:
        """Arrivals drawn from what the door accepts, so the pool actually fills."""
        cfg = self.s.config
        most = min(cfg.context_tokens, cfg.num_blocks * cfg.block_size)
        if most < 2:
            return
        for _ in range(n):
            prompt = data.draw(st.integers(1, most - 1), label="prompt")
            max_tokens = data.draw(st.integers(1, most - prompt), label="max_tokens")
            seq = self.s.add([1 + i % 9 for i in range(prompt)], max_tokens, frozenset({STOP}))
            note(f"arrive prompt={prompt} max_tokens={max_tokens}: seq {seq}")
            self.issued.append(seq)

    @rule()
    def admit(self) -> None:
        queue = list(self.s.waiting_ids())
        admitted = self.s.admit_waiting()
        note(f"admit: {list(admitted)} from queue {queue}")
        self._check_fcfs(queue, admitted)
        if self.s.config.policy is not Policy.FREE_SLOT and not self.s.running_ids():
            # Rule 1 makes every waiter fit an empty pool: an idle scheduler that keeps
            # a queue would wait for a wake-up no step will ever send.
            assert not self.s.waiting_ids(), "idle, yet the queue was not admitted"
        self._set_deadlines()

    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data: st.DataObject, n: int) -> None:
        """n turns of the batch loop; each usually admits first, as the real loop does."""
        for _ in range(n):
            if data.draw(st.integers(0, 3), label="admit first?") > 0:
                self.admit()
            self._one_step(data)

    def _one_step(self, data: st.DataObject) -> None:
        s = self.s
        queue = list(s.waiting_ids())
        plan = s.plan_step()
        readmitted = [q for q in queue if q in s.running_ids()]
        # A readmitted (preempted) sequence must be the head each time: no overtaking.
        assert readmitted == queue[: len(readmitted)], (readmitted, queue)
        for q in readmitted:
            self.passed.pop(q, None)
        self._check_plan(plan)
        if plan.is_empty:
            note(f"step: nothing to run (running={list(s.running_ids())})")
            if s.running_ids():
                assert s.config.policy is Policy.FREE_SLOT
                admissible = any(s.would_admit(w) for w in s.waiting_ids())
                assert s.statistics().deadlocked == (not admissible), "the detector is exact"
                self._check_deadlock_report()
                report = s.deadlock_report()
                if self.CHECK_LIVENESS and report is not None:
                    raise AssertionError(f"liveness violated: {report.describe()}")
            return
        tokens = []
        for c in plan.chunks:
            if c.sample:
                eos = data.draw(st.integers(0, 15), label=f"eos? seq {c.seq_id}") == 0
                tok = STOP if eos else 5
                tokens.append(SampledToken(c.seq_id, tok))
        cancel_mid_step = None
        if self.ENDS_EARLY and data.draw(st.integers(0, 3), label="cancel mid-step?") == 0:
            cancel_mid_step = data.draw(st.sampled_from([None, *self.issued]), label="which")
        if cancel_mid_step is not None and cancel_mid_step not in self.ended:
            s.cancel(cancel_mid_step)
            self.ended.add(cancel_mid_step)
        finished = s.commit(StepResult(plan.step, tuple(tokens), plan.n_rows))
        note(
            f"step {plan.step}: "
            + ", ".join(
                f"{c.seq_id}:{'P' if c.prefill else 'D'}{c.n_rows}{'*' if c.sample else ''}"
                for c in plan.chunks
            )
            + (f" (cancelled {cancel_mid_step} mid-step)" if cancel_mid_step is not None else "")
            + f" -> finished {[f.seq_id for f in finished]}"
        )
        stats = s.statistics()
        event(f"a step ran {'several' if len(plan.chunks) > 1 else 'one'} sequence(s)")
        if stats.preemptions_total:
            event("a preemption happened")
        if any(c.prefill for c in plan.chunks) and any(not c.prefill for c in plan.chunks):
            event("a chunk rode with decodes")
        for f in finished:
            event(f"a sequence finished ({f.reason.value})")
            assert f.seq_id not in self.ended
            self.ended.add(f.seq_id)
            self.deadline.pop(f.seq_id, None)
        for seq_id, due in self.deadline.items():
            if seq_id in s.running_ids():
                event("the liveness bound was checked")
                assert plan.step < due, f"seq {seq_id} still running after its bound (step {due})"
        self._set_deadlines()

    @precondition(lambda self: self.ENDS_EARLY and bool(self.issued))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.issued), label="seq to cancel")
        note(f"cancel {seq} ({self.s.state(seq).value})")
        self.s.cancel(seq)
        assert self.s.state(seq) in (SeqState.CANCELLED, SeqState.FINISHED)
        self.ended.add(seq)
        self.deadline.pop(seq, None)
        self.passed.pop(seq, None)

    @precondition(lambda self: self.ENDS_EARLY and bool(self.issued))
    @rule(data=st.data())
    def finish_early(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.issued), label="seq a stop string ends")
        note(f"finish {seq} ({self.s.state(seq).value})")
        self.s.finish(seq)
        self.ended.add(seq)
        self.deadline.pop(seq, None)
        self.passed.pop(seq, None)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def blocks_are_conserved(self) -> None:
        if not hasattr(self, "s"):
            return
        st_ = self.s.pool.statistics()
        held_by_tables = sum(len(self.s.sequence(q).blocks) for q in self.s.running_ids())
        assert st_.free + st_.held == st_.total
        assert held_by_tables == st_.held, (held_by_tables, st_)

    @invariant()
    def no_block_has_two_live_owners(self) -> None:
        if not hasattr(self, "s"):
            return
        seen: dict[int, int] = {}
        for q in self.s.running_ids():
            for b in self.s.sequence(q).blocks:
                assert b not in seen, f"block {b} held by seq {seen[b]} and seq {q}"
                seen[b] = q
                assert self.s.pool.refcount(b) == 1

    @invariant()
    def ended_and_waiting_sequences_hold_nothing(self) -> None:
        if not hasattr(self, "s"):
            return
        running = set(self.s.running_ids())
        for q in self.ended:
            assert self.s.state(q) in (SeqState.FINISHED, SeqState.CANCELLED)
            assert q not in running
        for q in self.s.waiting_ids():
            assert self.s.sequence(q).blocks == ()
        assert len(running) <= self.s.config.slots

    @invariant()
    def reserved_sequences_hold_their_whole_answer(self) -> None:
        if not hasattr(self, "s") or self.s.config.policy not in (Policy.RESERVE, Policy.STATIC):
            return
        bs = self.s.config.block_size
        for q in self.s.running_ids():
            info = self.s.sequence(q)
            assert len(info.blocks) == blocks_for(info.prompt_len + info.max_tokens, bs)

    # -- helpers --------------------------------------------------------------------------

    def _check_plan(self, plan: object) -> None:
        from triollm.plan import StepPlan

        assert isinstance(plan, StepPlan)
        cfg = self.s.config
        assert plan.n_rows <= cfg.step_rows, "rows within the budget"
        ids = [c.seq_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "one chunk per sequence per step"
        kinds = [c.prefill for c in plan.chunks]
        assert kinds == sorted(kinds, reverse=True), "prefill chunks come before decode rows"
        for c in plan.chunks:
            info = self.s.sequence(c.seq_id)
            assert info.state in RUNNING_STATES
            assert 1 <= c.n_rows <= (cfg.chunk_tokens if c.prefill else 1), "chunk within limit"
            assert c.start == info.n_computed
            assert c.start + c.n_rows <= len(c.block_table) * cfg.block_size
            assert c.block_table == info.blocks
            assert c.start + c.n_rows <= cfg.context_tokens
        if cfg.policy is not Policy.FREE_SLOT and self.s.running_ids():
            assert not plan.is_empty, "while a sequence is admitted, every step computes a row"

    def _check_fcfs(self, queue: list[int], admitted: tuple[int, ...]) -> None:
        k = self.s.config.overtake_k
        rest = list(queue)
        for a in admitted:
            assert a in rest
            if a == rest[0]:
                self.passed.pop(a, None)
            else:
                head = rest[0]
                self.passed[head] = self.passed.get(head, 0) + 1
                assert self.passed[head] <= k, f"head {head} overtaken more than K={k} times"
                self.passed.pop(a, None)
            rest.remove(a)

    def _check_deadlock_report(self) -> None:
        report = self.s.deadlock_report()
        if report is None:
            return
        assert {h.seq_id for h in report.holders} == set(self.s.running_ids())
        for h in report.holders:
            assert h.blocks_needed > report.free_blocks, "a holder could have grown"

    def _set_deadlines(self) -> None:
        """Start the liveness clock for sequences the bound now covers."""
        s = self.s
        if not self.CHECK_LIVENESS or s.config.policy is Policy.FREE_SLOT:
            return
        live = [*s.running_ids(), *s.waiting_ids()]
        step = s.statistics().step
        for q in s.running_ids():
            if q in self.deadline:
                continue
            # reserve/static: from admission. preempt: from when it is the oldest live
            # sequence (the only one never chosen as a victim).
            if s.config.policy is Policy.PREEMPT and s.sequence(q).ticket != min(
                s.sequence(x).ticket for x in live
            ):
                continue
            self.deadline[q] = step + liveness_bound(s, q)
