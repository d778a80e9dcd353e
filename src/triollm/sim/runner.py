"""Replay a scenario through the real Scheduler with a fake executor.

The executor is the only fake: every step the Scheduler plans is "run" by handing
back one token per sampling chunk. Requests end at their ``answer`` length (their
max_tokens), so what differs between policies is only admission and composition,
which is the point of the seed's figure.

Time is counted in steps: at step ``t`` the requests arriving at ``t`` are added,
the queue admits, the Scheduler plans, and the plan is committed. A request's time
to first token is the number of steps from its arrival up to and including the
step that sampled its first token; its completion time likewise to its last.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from triollm.plan import SampledToken, StepPlan, StepResult
from triollm.policies import SchedulingPolicy, policy_name
from triollm.scheduler import DeadlockError, Infeasible, Policy, Scheduler
from triollm.sim.scenario import Scenario
from triollm.spec import SequenceSpec

STOP = 0  # the simulated model's EOS token; every other sampled token is 1

# A run that has not ended after this many steps per requested token is a bug in
# the scheduler (every policy here either finishes or reports its deadlock).
_STEPS_PER_TOKEN_LIMIT = 50


@dataclass(frozen=True, slots=True)
class RowRecord:
    """One request's rows in one step."""

    request: str
    kind: str  # "prefill" or "decode"
    start: int  # position of the first row
    rows: int
    sample: bool  # did this chunk produce a token


@dataclass(frozen=True, slots=True)
class SimStep:
    """What one simulated step did, and the state it ran in (after admission and
    planning). Not ``events.StepRecord``, the live service's record of a forward pass."""

    t: int
    rows: tuple[RowRecord, ...]  # empty: nothing ran this step
    slots: tuple[str | None, ...]  # which request holds each slot (None: free)
    blocks: tuple[str | None, ...]  # which request holds each block (None: free)
    waiting: tuple[str, ...]  # queue, head first
    events: tuple[str, ...]  # arrivals, admissions, first tokens, completions, preemptions
    written: int  # positions whose K/V is written, over all running requests
    shared: tuple[int, ...] = ()  # blocks held by two or more requests (the prefix cache)
    cached: tuple[int, ...] = ()  # free blocks whose content a later prompt can still hit
    # Each running request's block table, in position order, and how many of its
    # positions are written (the rest of the table is reserved for what comes).
    tables: tuple[tuple[str, tuple[int, ...], int], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    name: str
    arrival: int
    prompt: int
    answer: int
    admitted: int | None = None  # first admission step
    first_token: int | None = None  # step that sampled its first token
    done: int | None = None  # step that sampled its last token
    refused: str | None = None  # the door's reason, when it could never run
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache

    @property
    def ttft(self) -> int | None:
        """Steps from arrival to first token, inclusive."""
        return None if self.first_token is None else self.first_token - self.arrival + 1

    @property
    def completion(self) -> int | None:
        """Steps from arrival to the last token, inclusive."""
        return None if self.done is None else self.done - self.arrival + 1


@dataclass(frozen=True, slots=True)
class Deadlock:
    t: int  # the step at which nothing could run
    description: str  # who holds what, by request name
    holders: tuple[tuple[str, int, int], ...]  # (request, blocks held, blocks needed)


@dataclass(frozen=True, slots=True)
class Run:
    policy: Policy | SchedulingPolicy
    scenario: Scenario
    steps: tuple[SimStep, ...]
    outcomes: tuple[RequestOutcome, ...]
    deadlock: Deadlock | None
    preemptions: int
    final_cached: tuple[int, ...] = ()  # after the last step: blocks the prefix cache keeps

    @property
    def policy_name(self) -> str:
        return policy_name(self.policy)

    @property
    def description(self) -> str:
        p = self.policy
        return (p.implementation if isinstance(p, Policy) else p).description

    @property
    def total_steps(self) -> int:
        """Steps until every request finished (or until the deadlock)."""
        return len(self.steps)

    @property
    def utilisation(self) -> float:
        """Mean fraction of the pool's blocks held, over the steps that ran."""
        ran = [s for s in self.steps if s.rows]
        if not ran:
            return 0.0
        return sum(sum(b is not None for b in s.blocks) for s in ran) / (
            len(ran) * self.scenario.num_blocks
        )

    @property
    def written_fraction(self) -> float:
        """Of the positions held, the mean fraction actually written (the rest is reserve)."""
        ran = [s for s in self.steps if s.rows]
        held = sum(sum(b is not None for b in s.blocks) for s in ran) * self.scenario.block_size
        return sum(s.written for s in ran) / held if held else 0.0


def simulate(scenario: Scenario, policy: Policy | SchedulingPolicy) -> Run:
    """Run every request of ``scenario`` under ``policy`` until all end or it deadlocks."""
    s = Scheduler(scenario.config(policy))
    outcomes = {
        r.name: RequestOutcome(r.name, r.arrival, r.prompt, r.answer) for r in scenario.requests
    }
    name_of: dict[int, str] = {}
    index = {r.name: i for i, r in enumerate(scenario.requests)}
    requests = {r.name: r for r in scenario.requests}
    arrivals = sorted(scenario.requests, key=lambda r: r.arrival)  # stable: file order at a tie
    limit = max(r.arrival for r in arrivals) + _STEPS_PER_TOKEN_LIMIT * sum(
        r.prompt + r.answer for r in arrivals
    )
    steps: list[SimStep] = []
    deadlock: Deadlock | None = None
    t = 0
    while True:
        events: list[str] = []
        while arrivals and arrivals[0].arrival == t:
            r = arrivals.pop(0)
            try:
                seq = s.add(
                    SequenceSpec(
                        scenario.prompt_ids(index[r.name]),
                        r.budget,
                        frozenset({STOP}),
                        priority=r.priority,
                    )
                )
            except Infeasible as exc:
                outcomes[r.name] = _with(outcomes[r.name], refused=str(exc))
                events.append(f"{r.name} refused")
                continue
            name_of[seq] = r.name
            events.append(f"{r.name} arrives")
        for r in scenario.requests:
            seq_of = {n: q for q, n in name_of.items()}
            if r.cancel == t and r.name in seq_of:
                q = seq_of[r.name]
                if q in s.running_ids() or q in s.waiting_ids():
                    s.cancel(q)
                    events.append(f"{r.name} cancelled")
        before = set(s.running_ids())
        if t not in scenario.skip_admission:
            s.admit_waiting()
        try:
            plan = s.plan_step()
        except DeadlockError:  # a policy that claims no deadlock, deadlocked: show it
            plan = StepPlan(step=s.statistics().step, chunks=())
        running = s.running_ids()
        for seq in running:
            if seq not in before:
                o = outcomes[name_of[seq]]
                again = s.sequence(seq).preemptions > 0
                events.append(f"{o.name} {'readmitted' if again else 'admitted'}")
                if o.admitted is None:
                    hit = s.sequence(seq).cached_tokens
                    outcomes[o.name] = _with(o, admitted=t, cached_tokens=hit)
                    if hit:
                        events.append(f"{o.name} found {hit} prompt tokens cached")
        for seq in (*running, *s.waiting_ids()):
            o = outcomes[name_of[seq]]
            count = s.sequence(seq).preemptions
            if count > o.preemptions:  # evicted by this plan (and perhaps readmitted since)
                outcomes[o.name] = _with(o, preemptions=count)
                events.append(f"{o.name} preempted")
        slots: list[str | None] = [None] * scenario.slots
        blocks: list[str | None] = [None] * scenario.num_blocks
        written = 0
        owners = [0] * scenario.num_blocks
        tables = []
        for seq in running:
            info = s.sequence(seq)
            assert info.slot is not None
            slots[info.slot] = name_of[seq]
            tables.append((name_of[seq], info.blocks, info.n_computed))
            for b in info.blocks:
                if blocks[b] is None:  # a shared block is drawn in its first holder's colour
                    blocks[b] = name_of[seq]
                owners[b] += 1
            written += info.n_computed
        # A shared block is full and counted once: its later holders did not write it.
        written -= scenario.block_size * sum(n - 1 for n in owners if n > 1)
        rows = tuple(
            RowRecord(
                name_of[c.seq_id], "prefill" if c.prefill else "decode", c.start, c.n_rows, c.sample
            )
            for c in plan.chunks
        )
        record = SimStep(
            t=t,
            rows=rows,
            slots=tuple(slots),
            blocks=tuple(blocks),
            waiting=tuple(name_of[q] for q in s.waiting_ids()),
            events=tuple(events),
            written=written,
            shared=tuple(b for b, n in enumerate(owners) if n > 1),
            cached=s.pool.cached_blocks(),
            tables=tuple(tables),
        )
        if plan.is_empty:
            report = s.deadlock_report()
            if report is not None:
                holders = tuple(
                    (name_of[h.seq_id], len(h.blocks), h.blocks_needed) for h in report.holders
                )
                description = "; ".join(
                    f"{n} holds {held} block(s) and needs {need} more" for n, held, need in holders
                )
                waiting = ", ".join(name_of[q] for q in report.waiting) or "none"
                free = report.free_blocks
                deadlock = Deadlock(
                    t=t,
                    description=f"{free} block(s) free; {description}; waiting: {waiting}",
                    holders=holders,
                )
                steps.append(_with_events(record, (*events, "DEADLOCK")))
                break
            if not s.running_ids() and not s.waiting_ids() and not arrivals:
                if events:
                    steps.append(record)
                break
            pending = any(r.cancel is not None and r.cancel > t for r in scenario.requests)
            skipped = t in scenario.skip_admission
            if not s.running_ids() and not arrivals and not pending and not skipped:
                # Idle with a queue the policy will not admit (only a broken policy gets
                # here: the door made every waiter fit an empty pool). Nothing will change.
                waiting = ", ".join(name_of[q] for q in s.waiting_ids())
                deadlock = Deadlock(
                    t=t,
                    description=f"nothing runs, and the policy admits none of: {waiting}",
                    holders=(),
                )
                steps.append(_with_events(record, (*events, "DEADLOCK")))
                break
            steps.append(record)
            t += 1
            continue
        # The model says EOS at a request's answer-th token when its budget is larger.
        eos_at = {q: requests[name_of[q]].answer for q in running}
        sampled = tuple(
            SampledToken(
                c.seq_id, STOP if s.sequence(c.seq_id).n_generated + 1 == eos_at[c.seq_id] else 1
            )
            for c in plan.chunks
            if c.sample
        )
        finished = s.commit(StepResult(plan.step, sampled, plan.n_rows))
        for c in plan.chunks:
            o = outcomes[name_of[c.seq_id]]
            if c.sample and o.first_token is None:
                outcomes[o.name] = _with(o, first_token=t)
                events.append(f"{o.name} first token")
        for f in finished:
            outcomes[name_of[f.seq_id]] = _with(outcomes[name_of[f.seq_id]], done=t)
            events.append(f"{name_of[f.seq_id]} done")
        steps.append(_with_events(record, tuple(events)))
        t += 1
        if t > limit:
            raise RuntimeError(f"the {policy_name(policy)} run did not end within {limit} steps")
    return Run(
        policy=policy,
        scenario=scenario,
        steps=tuple(steps),
        outcomes=tuple(outcomes[r.name] for r in scenario.requests),
        deadlock=deadlock,
        preemptions=s.statistics().preemptions_total,
        final_cached=s.pool.cached_blocks(),
    )


def _with(o: RequestOutcome, **changes: object) -> RequestOutcome:
    return replace(o, **changes)  # type: ignore[arg-type]


def _with_events(r: SimStep, events: tuple[str, ...]) -> SimStep:
    return replace(r, events=events)
