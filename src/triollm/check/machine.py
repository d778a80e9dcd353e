"""A hypothesis state machine that drives the real Scheduler with arbitrary events.

Rules are the verbs of the batch loop's world: requests ``arrive``, the queue
``admits``, the batch ``steps`` (its results end sequences at random with a stop
token, or at max_tokens), clients ``cancel`` and stop strings ``finish`` a
sequence early. A small model beside the Scheduler remembers what it promised.

Two kinds of check run after every rule:

- the Scheduler's own contracts (plans within their budgets, tables that cover
  the rows, an exact deadlock detector, the door): every policy, always;
- the policy's claims (:class:`~triollm.policies.Claim`): only those the policy
  declares (or the caller adds), so a policy is proved exactly as it promises.
  A broken claim raises :class:`ClaimViolated` naming it.

``property_tests/`` runs this machine for the built-in policies; ``triollm
check-policy`` runs it for any policy (``machine_for``). docs/scheduling.md
derives the liveness bound checked here; docs/policies.md shows a failure.

Needs hypothesis (the ``check`` extra, or ``dev``); nothing else in triollm does.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from triollm.kv import blocks_for, prefix_hashes
from triollm.plan import ChunkPlan, FinishReason, SampledToken, StepPlan, StepResult
from triollm.policies import Claim, Policy, SchedulingPolicy, builtin
from triollm.scheduler import (
    RUNNING_STATES,
    DeadlockError,
    Infeasible,
    Scheduler,
    SchedulerConfig,
    SeqState,
)
from triollm.spec import SequenceSpec

STOP = 0  # the stop token id every request is given; other tokens are 1..9

# The prefix cache's alphabet: three openings that agree on their first tokens and
# then part, and two salts, so hits (and near misses, and salt misses) are frequent.
OPENINGS = (
    (1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6),
    (1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 8, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 7),
    (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4),
)
SALTS = ("", "tenant-b")


class ClaimViolated(AssertionError):
    """A claim the policy makes does not hold; ``claim`` says which."""

    def __init__(self, claim: Claim, message: str) -> None:
        super().__init__(f"{claim.value} violated: {message}")
        self.claim = claim


def liveness_bound(s: Scheduler, seq_id: int) -> int:
    """Steps within which running sequence ``seq_id`` must end, counted from now.

    q = min(chunk, stall, rows - slots + 1) is the least a prefill chunk gets while
    it is the first prefill in admission order (rule 4: at most slots - 1 left-out
    decoders go before it, and beside a decoder the step's prefill is at most
    ``stall_rows``). Every prefilling sequence admitted before this one finishes its
    prompt first, each within ceil(remaining / q) steps; then this one's does. After
    that each answer token needs at most two steps (left out once, first next time).
    """
    cfg = s.config
    q = min(cfg.chunk_tokens, cfg.stall_rows, cfg.step_rows - cfg.slots + 1)
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
    # max_tokens 0 (a scored prompt, rule 11): it ends with its prompt's last chunk
    return steps + 2 * max(me.max_tokens - me.n_generated - 1, 0)


class SchedulerMachine(RuleBasedStateMachine):
    POLICY: Policy | SchedulingPolicy = Policy.RESERVE
    CLAIMS: frozenset[Claim] | None = None  # None: exactly what the policy claims
    ENDS_EARLY = True  # cancel / finish rules; the deadlock search drops them (they only unblock)
    PREFIX_CACHE = False  # share full blocks between sequences (Scheduler rule 9)

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler
        self.issued: list[int] = []
        self.ended: set[int] = set()
        self.passed: dict[int, int] = {}  # model: times each oldest waiter was overtaken
        self.deadline: dict[int, int] = {}  # seq_id -> step by which it must have ended
        self.trace: list[str] = []  # what happened, in words (check-policy prints it)
        self.turns = 0  # _one_step calls: the simulator's clock, for a replay
        self.now = 0  # the simulator's step the latest event belongs to (the page's ?step=)
        # The same story as data, in the simulator's terms (check/replay.py reads it).
        self.log: list[tuple[object, ...]] = []
        impl = self.POLICY if not isinstance(self.POLICY, Policy) else builtin(self.POLICY)
        self.claims = impl.claims if self.CLAIMS is None else self.CLAIMS
        if self.PREFIX_CACHE:
            # Sharing is the point: blocks have several owners. What replaces the claim
            # is checked for every policy: refcounts equal the live holders, a shared
            # block is full and published, one writer per block (see the invariants).
            self.claims = self.claims - {Claim.EXCLUSIVE_BLOCKS}
        self.salt: dict[int, str] = {}  # seq_id -> its cache salt
        # model: block -> offset -> the token history whose K/V the Batch wrote there
        # (K/V at position p is a function of tokens 0..p, RoPE included).
        self.written: dict[int, dict[int, tuple[int, ...]]] = {}
        self.expected: dict[int, bytes] = {}  # model: block -> hash of what was written last
        # seq_id -> its group (the n choices of one prompt, Scheduler rule 10); this
        # machine adds none, property_tests/test_group_properties.py does.
        self.group_of: dict[int, int] = {}
        # Scheduler rule 11, a scored prompt: seq_id -> (its preemptions, the position its
        # next chunk must start at), until its first token. Its chunks run from position
        # 0 without a gap (no cache hit), again from 0 after a preemption. This machine
        # adds none, property_tests/test_scoring_properties.py does.
        self.scoring: dict[int, tuple[int, int]] = {}

    # -- claims -----------------------------------------------------------------------

    def claimed(self, claim: Claim) -> bool:
        return claim in self.claims

    def check(self, claim: Claim, holds: bool, message: str) -> None:
        if claim in self.claims and not holds:
            raise ClaimViolated(claim, message)

    def say(self, line: str) -> None:
        note(line)
        self.trace.append(line)

    @initialize(
        block_size=st.integers(1, 6),
        num_blocks=st.integers(2, 24),
        slots=st.integers(1, 4),
        chunk=st.integers(1, 12),
        stall=st.integers(0, 12),
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
        stall: int,
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
            # 0: the chunk (SchedulerConfig's default); otherwise a budget below it
            stall_rows=min(stall, chunk) or chunk,
            step_rows=slots + extra_rows,
            context_tokens=context,
            policy=self.POLICY,
            overtake_limit=min(overtake, slots),
            preempt_watermark_blocks=watermark,
            prefix_cache=self.PREFIX_CACHE,
        )
        self.s = Scheduler(cfg)
        self.log.append(
            (
                "config",
                {
                    "slots": slots,
                    "num_blocks": num_blocks,
                    "block_size": block_size,
                    "chunk_tokens": chunk,
                    "stall_rows": cfg.stall_rows,
                    "step_rows": cfg.step_rows,
                    "context_tokens": context,
                    "overtake_limit": cfg.overtake_k,
                    "preempt_watermark_blocks": watermark,
                },
            )
        )
        self.say(
            f"config: {num_blocks} blocks of {block_size} positions, {slots} slot(s), "
            f"chunks of {chunk} ({cfg.stall_rows} beside a decoder), {cfg.step_rows} rows "
            f"a step, context {context}, "
            f"overtake limit K={cfg.overtake_k}, watermark {watermark}"
        )

    # -- rules ----------------------------------------------------------------------

    @rule(prompt=st.integers(0, 40), max_tokens=st.none() | st.integers(0, 40))
    def arrive(self, prompt: int, max_tokens: int | None) -> None:
        spec = SequenceSpec([1 + i % 9 for i in range(prompt)], max_tokens, frozenset({STOP}))
        reason = self.s.feasible(prompt, max_tokens)
        # The door asks check_group (admission.py), feasible is its question for one
        # sequence: both, and add, must give one answer (one rule, _infeasible).
        try:
            self.s.check_group(spec)
        except Infeasible as exc:
            assert reason == str(exc), (reason, str(exc))
        else:
            assert reason is None, reason
        try:
            seq = self.s.add(spec)
        except Infeasible as exc:
            self.say(f"arrive prompt={prompt} max_tokens={max_tokens}: refused ({exc.field})")
            assert reason == str(exc)
            assert exc.field in ("prompt", "max_tokens")
            return
        assert reason is None
        answer = self.s.sequence(seq).max_tokens
        self.say(f"seq {seq} arrives: prompt {prompt}, max_tokens {answer}")
        self.log.append(("arrive", self.turns, seq, prompt, answer, 0))
        self.issued.append(seq)

    def longest_request(self) -> int:
        """The most positions one request can hold: the context, or the whole pool."""
        cfg = self.s.config
        return min(cfg.context_tokens, cfg.num_blocks * cfg.block_size)

    @staticmethod
    def draw_lengths(data: st.DataObject, most: int) -> tuple[int, int]:
        """A prompt and an answer that fit ``most`` positions together."""
        prompt = data.draw(st.integers(1, most - 1), label="prompt")
        return prompt, data.draw(st.integers(1, most - prompt), label="max_tokens")

    @rule(data=st.data(), n=st.integers(1, 3))
    def arrive_fitting(self, data: st.DataObject, n: int) -> None:
        """Arrivals drawn from what the door accepts, so the pool actually fills."""
        most = self.longest_request()
        if most < 2:
            return
        for _ in range(n):
            prompt, max_tokens = self.draw_lengths(data, most)
            priority = data.draw(st.integers(0, 2), label="priority")
            seq = self.s.add(
                SequenceSpec(
                    [1 + i % 9 for i in range(prompt)],
                    max_tokens,
                    frozenset({STOP}),
                    priority=priority,
                )
            )
            self.say(
                f"seq {seq} arrives: prompt {prompt}, max_tokens {max_tokens}"
                + (f", priority {priority}" if priority else "")
            )
            self.log.append(("arrive", self.turns, seq, prompt, max_tokens, priority))
            self.issued.append(seq)

    # Only with the cache on: with it off a prompt's contents change nothing, and the
    # rule would only dilute the search (and the stories check-policy tells).
    @precondition(lambda self: self.PREFIX_CACHE)
    @rule(
        data=st.data(),
        opening=st.sampled_from(OPENINGS),
        salt=st.sampled_from(SALTS),
        n=st.integers(1, 3),
    )
    def arrive_sharing(
        self, data: st.DataObject, opening: tuple[int, ...], salt: str, n: int
    ) -> None:
        """Arrivals whose prompts start with a shared opening, so the cache hits."""
        most = self.longest_request()
        if most < 2:
            return
        for _ in range(n):
            prompt, max_tokens = self.draw_lengths(data, most)
            ids = [*opening, *(1 + i % 7 for i in range(max(0, prompt - len(opening))))]
            seq = self.s.add(
                SequenceSpec(ids[:prompt], max_tokens, frozenset({STOP}), cache_salt=salt)
            )
            self.salt[seq] = salt
            # The replay's simulator feeds [1] * prompt: the same plans, with the cache off.
            self.log.append(("arrive", self.turns, seq, prompt, max_tokens, 0))
            self.say(
                f"seq {seq} arrives: prompt {prompt} opening with {opening[:3]}..., "
                f"salt {salt!r}, max_tokens {max_tokens}"
            )
            self.issued.append(seq)

    @rule()
    def admit(self) -> None:
        self.now = self.turns  # the simulator admits at the start of the next step
        queue = list(self.s.waiting_ids())
        admitted = self.s.admit_waiting()
        if admitted:
            self.say(f"admit: {self._holdings(admitted)} (queue was {queue})")
        self._check_fcfs(queue, admitted)
        if not self.s.running_ids():
            # Rule 1 makes every waiter fit an empty pool: an idle scheduler that keeps
            # a queue would wait for a wake-up no step will ever send.
            self.check(
                Claim.NO_DEADLOCK,
                not self.s.waiting_ids(),
                f"idle, yet the queue {list(self.s.waiting_ids())} was not admitted",
            )
        self._set_deadlines()

    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data: st.DataObject, n: int) -> None:
        """n turns of the batch loop; each usually admits first, as the real loop does."""
        for _ in range(n):
            # 0 (what a shrink aims for) admits: a shrunk story reads like the real loop.
            if data.draw(st.integers(0, 3), label="admit first? (3 = no)") < 3:
                self.admit()
            else:
                self.say("(a turn without an admission pass)")
                self.log.append(("skip_admission", self.turns))
            self._one_step(data)

    def _one_step(self, data: st.DataObject) -> None:
        s = self.s
        self.now = self.turns
        self.turns += 1
        queue = list(s.waiting_ids())
        order = list(s.waiting_order())
        try:
            plan = s.plan_step()
        except DeadlockError as exc:
            self.log.append(("plan", self.turns - 1, ()))
            self.say(f"step {self.turns - 1}: NOTHING CAN MOVE. {exc.report.describe()}")
            raise ClaimViolated(Claim.NO_DEADLOCK, exc.report.describe()) from None
        readmitted = [q for q in queue if q in s.running_ids()]
        # Only a preempted sequence is readmitted by plan_step, and only the one first
        # in line (so, under FCFS, readmission never overtakes anyone).
        assert all(s.sequence(q).preemptions for q in readmitted), readmitted
        assert not readmitted or order[0] in readmitted, (readmitted, order)
        if readmitted:
            self.say(f"readmit (preempted earlier): {self._holdings(readmitted)}")
        self._check_fcfs(queue, tuple(sorted(readmitted, key=order.index)))
        self._check_plan(plan)
        self._record_writes(plan)
        if plan.is_empty:
            self.log.append(("plan", self.turns - 1, ()))
            if s.running_ids():
                admissible = any(s.would_admit(w) for w in s.waiting_ids())
                assert s.statistics().deadlocked == (not admissible), "the detector is exact"
                self._check_deadlock_report()
                report = s.deadlock_report()
                if report is not None:
                    self.say(f"step {self.turns - 1}: NOTHING CAN MOVE. {report.describe()}")
                    self.check(Claim.NO_DEADLOCK, False, report.describe())
                self.check(
                    Claim.NO_DEADLOCK,
                    False,
                    f"no row planned while {list(s.running_ids())} run",
                )
            self.say(f"step {self.turns - 1}: nothing to run")
            return
        tokens = []
        eos: list[int] = []
        for c in plan.chunks:
            if c.sample:
                stop = data.draw(st.integers(0, 15), label=f"eos? seq {c.seq_id} (0 = yes)") == 0
                if stop:
                    eos.append(c.seq_id)
                tokens.append(SampledToken(c.seq_id, STOP if stop else 5))
        cancel_mid_step = None
        if self.ENDS_EARLY and data.draw(st.integers(0, 3), label="cancel mid-step?") == 0:
            cancel_mid_step = data.draw(st.sampled_from([None, *self.issued]), label="which")
        if cancel_mid_step is not None and cancel_mid_step not in self.ended:
            s.cancel(cancel_mid_step)
            self.ended.add(cancel_mid_step)
            self.log.append(("cancel_mid", self.turns - 1, cancel_mid_step))
        self.log.append(
            (
                "plan",
                self.turns - 1,
                tuple((c.seq_id, c.prefill, c.start, c.n_rows) for c in plan.chunks),
            )
        )
        finished = s.commit(StepResult(plan.step, tuple(tokens), plan.n_rows))
        self.say(
            f"step {self.turns - 1}: "
            + ", ".join(
                f"seq {c.seq_id} {'prefill' if c.prefill else 'decode'} "
                f"{c.start}..{c.start + c.n_rows - 1}" + (" EOS" if c.seq_id in eos else "")
                for c in plan.chunks
            )
            + ("" if cancel_mid_step is None else f" (seq {cancel_mid_step} cancelled mid-step)")
            + (f"; seq {', '.join(str(f.seq_id) for f in finished)} done" if finished else "")
            + f" | {self._pool_line()}"
        )
        stats = s.statistics()
        event(f"a step ran {'several' if len(plan.chunks) > 1 else 'one'} sequence(s)")
        if stats.preemptions_total:
            event("a preemption happened")
        if any(c.prefill for c in plan.chunks) and any(not c.prefill for c in plan.chunks):
            event("a chunk rode with decodes")
        for f in finished:
            if f.reason is FinishReason.STOP:
                self.log.append(("eos", f.seq_id, f.n_generated))
            event(f"a sequence finished ({f.reason.value})")
            assert f.seq_id not in self.ended
            self.ended.add(f.seq_id)
            self.deadline.pop(f.seq_id, None)
        for seq_id, due in self.deadline.items():
            if seq_id in s.running_ids():
                event("the liveness bound was checked")
                claim = (
                    Claim.LIVENESS if self.claimed(Claim.LIVENESS) else Claim.LIVENESS_OF_THE_OLDEST
                )
                late = f"seq {seq_id} still running after its bound (step {due})"
                self.check(claim, plan.step < due, late)
        self._set_deadlines()

    @precondition(lambda self: self.ENDS_EARLY and bool(self.issued))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.issued), label="seq to cancel")
        self.say(f"cancel seq {seq} ({self.s.state(seq).value})")
        self.log.append(("cancel", self.turns, seq))
        self.s.cancel(seq)
        assert self.s.state(seq) in (SeqState.CANCELLED, SeqState.FINISHED)
        self.ended.add(seq)
        self.deadline.pop(seq, None)
        self.passed.pop(seq, None)

    @precondition(lambda self: self.ENDS_EARLY and bool(self.issued))
    @rule(data=st.data())
    def finish_early(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.issued), label="seq a stop string ends")
        self.say(f"a stop string ends seq {seq} ({self.s.state(seq).value})")
        self.log.append(("cancel", self.turns, seq))
        self.s.finish(seq)
        self.ended.add(seq)
        self.deadline.pop(seq, None)
        self.passed.pop(seq, None)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def blocks_are_conserved(self) -> None:
        if not self.claimed(Claim.BLOCKS_CONSERVED):
            return
        s = self.s
        st_ = s.pool.statistics()
        held_by_tables = len({b for q in s.running_ids() for b in s.sequence(q).blocks})
        self.check(
            Claim.BLOCKS_CONSERVED,
            st_.free + st_.cached + st_.held == st_.total,
            f"{st_.free} free + {st_.cached} cached + {st_.held} held != {st_.total}",
        )
        self.check(
            Claim.BLOCKS_CONSERVED,
            held_by_tables == st_.held,
            f"the pool says {st_.held} held, the live tables hold {held_by_tables}",
        )
        bs = s.config.block_size
        for q in s.running_ids():
            info = s.sequence(q)
            reach = blocks_for(info.prompt_len + info.max_tokens, bs)
            self.check(
                Claim.BLOCKS_CONSERVED,
                len(info.blocks) <= reach,
                f"seq {q} holds {len(info.blocks)} blocks {list(info.blocks)} but its "
                f"{info.prompt_len} + {info.max_tokens} positions can only ever write {reach}: "
                f"block {info.blocks[-1]} is leaked until it ends",
            )
            if not s.policy.grows:  # a reserving policy holds exactly the whole answer
                self.check(Claim.BLOCKS_CONSERVED, len(info.blocks) == reach, f"seq {q} short")

    @invariant()
    def no_block_has_two_live_owners(self) -> None:
        if not self.claimed(Claim.EXCLUSIVE_BLOCKS):
            return
        seen: dict[int, int] = {}
        for q in self.s.running_ids():
            for b in self.s.sequence(q).blocks:
                self.check(
                    Claim.EXCLUSIVE_BLOCKS,
                    b not in seen,
                    f"block {b} held by seq {seen.get(b)} and seq {q}",
                )
                seen[b] = q
                self.check(
                    Claim.EXCLUSIVE_BLOCKS,
                    self.s.pool.refcount(b) == 1,
                    f"block {b} has {self.s.pool.refcount(b)} references",
                )

    @invariant()
    def refcounts_equal_the_live_holders(self) -> None:
        """Every block's reference count is the number of live tables naming it, and a
        block named twice is full and published (nobody will ever write it again)."""
        if not hasattr(self, "s"):
            return
        s = self.s
        holders: dict[int, int] = {}
        for q in s.running_ids():
            for b in s.sequence(q).blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in range(s.config.num_blocks):
            assert s.pool.refcount(b) == holders.get(b, 0), (
                f"block {b} has {s.pool.refcount(b)} reference(s) but "
                f"{holders.get(b, 0)} live table(s) name it"
            )
            if holders.get(b, 0) > 1:
                self._check_shared(b)
        if not s.config.prefix_cache:
            assert s.pool.statistics().cached == 0, "with the cache off nothing is cached"

    def _check_shared(self, b: int) -> None:
        """A block in several tables is written by one of them at most, and nobody reads
        it before it is written: either every holder has computed past it (a cache hit
        on a published block, or a group's prompt block already written), or exactly one
        holder is still writing it and every other one waits for that one (rule 10)."""
        s = self.s
        bs = s.config.block_size
        holders = [q for q in s.running_ids() if b in s.sequence(q).blocks]
        writers = [
            q
            for q in holders
            if s.sequence(q).n_computed < (s.sequence(q).blocks.index(b) + 1) * bs
        ]
        assert len(writers) <= 1, f"block {b} is shared and seqs {writers} may all write it"
        if writers:
            (w,) = writers
            assert s.pool.content(b) is None, f"published block {b} has a writer, seq {w}"
            for q in holders:
                if q != w:
                    assert s.sequence(q).waits_for == w, (
                        f"seq {q} shares block {b}, which seq {w} is still writing, "
                        "without waiting for it"
                    )
        elif not self.group_of:
            # Without groups only the prefix cache shares, and only published blocks.
            assert s.pool.content(b) is not None, f"block {b} is shared but not published"

    @invariant()
    def every_published_block_holds_what_its_hash_says(self) -> None:
        """A cached (or shared) block's hash is the hash of what was written into it
        and into the blocks before it, and every sequence attends over its own tokens."""
        if not hasattr(self, "s"):
            return
        s = self.s
        for b in range(s.config.num_blocks):
            h = s.pool.content(b)
            if h is not None:
                assert h == self.expected.get(b), f"block {b}'s hash is not what was written"
        bs = s.config.block_size
        for q in s.running_ids():
            info = s.sequence(q)
            if info.waits_for is not None:
                continue  # its shared blocks are still being written; it reads nothing yet
            ids = s.token_ids(q)
            for p in range(info.n_computed):
                fed = self.written.get(info.blocks[p // bs], {}).get(p % bs)
                assert fed == ids[: p + 1], (
                    f"seq {q} position {p} (block {info.blocks[p // bs]}) holds the K/V of "
                    f"history {fed}, not of its own {ids[: p + 1]}"
                )

    @invariant()
    def ended_and_waiting_sequences_hold_nothing(self) -> None:
        running = set(self.s.running_ids())
        for q in self.ended:
            assert self.s.state(q) in (SeqState.FINISHED, SeqState.CANCELLED)
            assert q not in running
        for q in self.s.waiting_ids():
            assert self.s.sequence(q).blocks == ()
        assert len(running) <= self.s.config.slots

    # -- helpers --------------------------------------------------------------------------

    def _holdings(self, seqs: Iterable[int]) -> str:
        return ", ".join(f"seq {q} takes blocks {list(self.s.sequence(q).blocks)}" for q in seqs)

    def _pool_line(self) -> str:
        s = self.s
        held = " ".join(f"{q}:{list(s.sequence(q).blocks)}" for q in s.running_ids())
        waiting = list(s.waiting_ids())
        pool = s.pool.statistics()
        cached = f" ({pool.cached} cached)" if pool.cached else ""
        return f"blocks {held or 'none held'}, {pool.available} free{cached}" + (
            f"; waiting {waiting}" if waiting else ""
        )

    def _check_plan(self, plan: StepPlan) -> None:
        cfg = self.s.config
        assert plan.n_rows <= cfg.step_rows, "rows within the budget"
        ids = [c.seq_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "one chunk per sequence per step"
        kinds = [c.prefill for c in plan.chunks]
        assert kinds == sorted(kinds, reverse=True), "prefill chunks come before decode rows"
        if not all(kinds):  # a decoder rides: the step's prefill is its stall (rule 4)
            prefill_rows = sum(c.n_rows for c in plan.chunks if c.prefill)
            assert prefill_rows <= cfg.stall_rows, (
                f"{prefill_rows} prefill rows beside a decode row, past the stall budget "
                f"{cfg.stall_rows}: the decoders' stall is unbounded"
            )
        written_by: dict[int, int] = {}
        for c in plan.chunks:
            info = self.s.sequence(c.seq_id)
            assert info.state in RUNNING_STATES
            assert 1 <= c.n_rows <= (cfg.chunk_tokens if c.prefill else 1), "chunk within limit"
            assert c.start == info.n_computed
            assert c.start + c.n_rows <= len(c.block_table) * cfg.block_size
            assert c.block_table == info.blocks
            assert c.start + c.n_rows <= cfg.context_tokens
            # One writer per block: a block this chunk writes is held by it alone and
            # unpublished; a shared or cached block is never written.
            bs = cfg.block_size
            for b in {c.block_table[p // bs] for p in range(c.start, c.start + c.n_rows)}:
                assert b not in written_by, (
                    f"block {b} written by seq {written_by[b]} and {c.seq_id}"
                )
                written_by[b] = c.seq_id
                # A shared block is written only by a group's writer, while every other
                # holder waits for it (rule 10); without groups, never.
                for q in self.s.running_ids():
                    if q != c.seq_id and b in self.s.sequence(q).blocks:
                        assert self.s.sequence(q).waits_for == c.seq_id, (
                            f"seq {c.seq_id} writes block {b}, which seq {q} shares"
                        )
                assert self.s.pool.content(b) is None, f"seq {c.seq_id} writes published block {b}"
            assert info.waits_for is None, f"seq {c.seq_id} runs before its writer is done"
            self._check_scoring(c)

    def _check_scoring(self, c: ChunkPlan) -> None:
        """Rule 11: a scored prompt's chunks cover it from 0 with no gap, each row
        naming its next prompt token, and only its final chunk is sampled (never, with
        max_tokens 0)."""
        if c.seq_id not in self.scoring:
            assert not c.score_ids, f"seq {c.seq_id} is scored, but never asked to be"
            return
        info = self.s.sequence(c.seq_id)
        preemptions, start = self.scoring[c.seq_id]
        if info.preemptions != preemptions:
            start = 0  # evicted: it recomputes (and rescores) from the first position
        assert c.start == start, (
            f"scored seq {c.seq_id} computes from {c.start}, not {start}: "
            "a cache hit skipped positions whose log-probabilities were asked for"
        )
        ids = self.s.token_ids(c.seq_id)
        end = c.start + c.n_rows
        assert c.score_ids == tuple(ids[c.start + 1 : min(end + 1, info.prompt_len)])
        assert c.sample == (end == info.prompt_len and info.max_tokens > 0)
        self.scoring[c.seq_id] = (info.preemptions, end)
        if end == info.prompt_len:  # the prompt is scored: the first token, or the end
            del self.scoring[c.seq_id]

    def _record_writes(self, plan: StepPlan) -> None:
        """Model the Batch: each row's K/V lands in its block; a block whose last offset
        is written now holds the chain hash of everything its table fed so far."""
        bs = self.s.config.block_size
        for c in plan.chunks:
            ids = self.s.token_ids(c.seq_id)
            for i, token in enumerate(c.token_ids):
                p = c.start + i
                assert ids[p] == token, f"seq {c.seq_id} fed {token} at {p}, not {ids[p]}"
                block = c.block_table[p // bs]
                self.written.setdefault(block, {})[p % bs] = ids[: p + 1]
                if p % bs == bs - 1:
                    salt = self.salt.get(c.seq_id, "")
                    self.expected[block] = prefix_hashes(ids[: p + 1], bs, salt)[-1]

    def _check_fcfs(self, queue: list[int], admitted: tuple[int, ...]) -> None:
        """Replay admissions against a model queue in arrival order: each admission of
        someone other than the oldest waiter passes the oldest once."""
        if not self.claimed(Claim.BOUNDED_OVERTAKING):
            return
        bound = self.s.policy.overtake_bound(self.s.config.overtake_k)
        rest = list(queue)
        last_group = None
        for a in admitted:
            assert a in rest
            group = self.group_of.get(a)
            if group is not None and group == last_group:
                rest.remove(a)  # a group passes as one: its members arrived together
                self.passed.pop(a, None)
                continue
            last_group = group
            if a == rest[0]:
                self.passed.pop(a, None)
            else:
                head = rest[0]
                self.passed[head] = self.passed.get(head, 0) + 1
                self.check(
                    Claim.BOUNDED_OVERTAKING,
                    self.passed[head] <= bound,
                    f"seq {head}, waiting longest, was passed {self.passed[head]} time(s) "
                    f"(the bound is {bound}); seq {a} just went ahead of it",
                )
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
        every = self.claimed(Claim.LIVENESS)
        if not every and not self.claimed(Claim.LIVENESS_OF_THE_OLDEST):
            return
        live = [*s.running_ids(), *s.waiting_ids()]
        step = s.statistics().step
        for q in s.running_ids():
            if q in self.deadline:
                continue
            # LIVENESS: from admission. Of the oldest (an evicting policy): from when it
            # is the oldest live sequence (the only one never chosen as a victim).
            if not every and s.sequence(q).ticket != min(s.sequence(x).ticket for x in live):
                continue
            self.deadline[q] = step + liveness_bound(s, q)


def machine_for(
    policy: Policy | SchedulingPolicy,
    claims: frozenset[Claim] | None = None,
    *,
    ends_early: bool = True,
    prefix_cache: bool = False,
) -> type[SchedulerMachine]:
    """A state machine class that checks ``policy`` against ``claims`` (default: its own),
    with the Scheduler's prefix cache on or off."""
    name = policy.value if isinstance(policy, Policy) else policy.name
    return type(
        f"Machine_{name}{'_prefix_cache' if prefix_cache else ''}",
        (SchedulerMachine,),
        {
            "POLICY": policy,
            "CLAIMS": claims,
            "ENDS_EARLY": ends_early,
            "PREFIX_CACHE": prefix_cache,
        },
    )
