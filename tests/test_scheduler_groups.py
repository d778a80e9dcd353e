"""Rule 10: the n choices of one prompt are admitted together and prefill it once."""

from __future__ import annotations

import pytest

from triollm.kv import blocks_for
from triollm.plan import SampledToken, StepPlan, StepResult
from triollm.policies import SeqView, builtin
from triollm.scheduler import Infeasible, Policy, Scheduler, SchedulerConfig, SeqState
from triollm.spec import SequenceSpec

PROMPT = list(range(1, 41))  # 40 tokens: 10 blocks of 4, the last one the prompt's own


def make(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_blocks=64, block_size=4, slots=4, chunk_tokens=8, step_rows=12, context_tokens=64
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def run_step(s: Scheduler) -> StepPlan:
    plan = s.plan_step()
    if not plan.is_empty:
        sampled = tuple(SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample)
        s.commit(StepResult(plan.step, sampled, plan.n_rows))
    return plan


def prefill_rows(plans: list[StepPlan]) -> dict[int, int]:
    rows: dict[int, int] = {}
    for plan in plans:
        for c in plan.chunks:
            if c.prefill:
                rows[c.seq_id] = rows.get(c.seq_id, 0) + c.n_rows
    return rows


def run_to_the_end(s: Scheduler, limit: int = 200) -> list[StepPlan]:
    plans = []
    for _ in range(limit):
        s.admit_waiting()
        plan = run_step(s)
        if plan.is_empty and not s.running_ids():
            return plans
        plans.append(plan)
    raise AssertionError("did not finish")


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_n_choices_of_one_prompt_prefill_it_once(prefix_cache: bool) -> None:
    s = make(prefix_cache=prefix_cache)
    writer, *others = s.add_group(SequenceSpec(PROMPT, 4, n=3))
    assert s.admit_waiting() == (writer, *others)
    # The writer computes the whole prompt; the others only their own last block
    # (positions 36..39): 40 + 4 + 4 prompt rows instead of 3 x 40.
    assert [s.sequence(q).cached_tokens for q in (writer, *others)] == [0, 36, 36]
    plans = run_to_the_end(s)
    assert prefill_rows(plans) == {writer: 40, others[0]: 4, others[1]: 4}
    assert s.statistics().finished_total == 3
    stats = s.pool.statistics()
    assert stats.held == 0 and stats.free + stats.cached == stats.total


def test_the_others_wait_until_the_writer_has_committed_the_shared_blocks() -> None:
    s = make(chunk_tokens=8)
    writer, other = s.add_group(SequenceSpec(PROMPT, 4, n=2))
    s.admit_waiting()
    assert s.sequence(other).waits_for == writer
    # 36 shared positions at 8 a step: 5 steps of the writer alone, then both.
    for _ in range(4):
        plan = run_step(s)
        assert [c.seq_id for c in plan.chunks] == [writer]
    plan = run_step(s)
    assert [c.seq_id for c in plan.chunks] == [writer]  # positions 32..39
    assert s.sequence(other).waits_for is None
    plan = run_step(s)
    assert other in [c.seq_id for c in plan.chunks]
    (chunk,) = [c for c in plan.chunks if c.seq_id == other]
    assert (chunk.start, chunk.n_rows) == (36, 4)
    assert chunk.block_table[:9] == s.sequence(writer).blocks[:9]


def test_admission_holds_the_prompts_blocks_once_and_each_answers_blocks() -> None:
    s = make()
    seqs = s.add_group(SequenceSpec(PROMPT, 8, n=3))
    s.admit_waiting()
    whole = blocks_for(40 + 8, 4)  # 12 blocks: the prompt's 10 and the answer's 2
    shared = 9  # (40 - 1) // 4: every full block but the one the last token is in
    assert s.pool.statistics().held == whole + 2 * (whole - shared)
    for q in seqs:
        assert s.pool.refcount(s.sequence(q).blocks[0]) == 3
        assert len(s.sequence(q).blocks) == whole


def test_a_group_is_admitted_all_together_or_not_at_all() -> None:
    # 12 + 3 + 3 = 18 blocks for the group; a holder of 4 leaves 16 of 20 free.
    s = make(num_blocks=20)
    holder = s.add(SequenceSpec([1] * 8, 8))
    assert s.admit_waiting() == (holder,)
    group = s.add_group(SequenceSpec(PROMPT, 8, n=3))
    free = s.pool.available()
    assert s.admit_waiting() == ()  # two members would fit; none is admitted
    assert s.pool.available() == free
    assert all(s.state(q) is SeqState.WAITING for q in group)
    s.cancel(holder)
    assert s.admit_waiting() == group


def test_a_group_the_slots_or_an_empty_pool_cannot_hold_is_refused_naming_n() -> None:
    s = make(slots=2)
    with pytest.raises(Infeasible) as err:
        s.add_group(SequenceSpec(PROMPT, 4, n=3))
    assert err.value.field == "n" and "more than the 2 slots" in str(err.value)
    s = make(num_blocks=15)  # one member needs 11 blocks, two 11 + 2 = 13, three 15
    s.add_group(SequenceSpec(PROMPT, 4, n=3))
    with pytest.raises(Infeasible) as err:
        s.add_group(SequenceSpec(PROMPT, 8, n=3))  # 12 + 3 + 3 = 18 > 15
    assert err.value.field == "n" and "the whole pool has 15" in str(err.value)
    assert s.statistics().waiting == 3  # the refused group queued nothing


def test_a_writer_that_leaves_early_hands_the_shared_blocks_to_the_next_member() -> None:
    s = make(chunk_tokens=8)
    writer, heir, third = s.add_group(SequenceSpec(PROMPT, 4, n=3))
    s.admit_waiting()
    run_step(s)
    run_step(s)  # the writer has committed 16 positions
    s.cancel(writer)
    assert s.sequence(heir).n_computed == 16 and s.sequence(heir).waits_for is None
    assert s.sequence(third).waits_for == heir
    plans = run_to_the_end(s)
    assert prefill_rows(plans) == {heir: 24, third: 4}
    assert s.pool.statistics().held == 0


def test_a_member_cancelled_while_waiting_leaves_the_rest_one_group() -> None:
    s = make(num_blocks=20)
    holder = s.add(SequenceSpec([1] * 8, 8))
    s.admit_waiting()
    a, b, c = s.add_group(SequenceSpec(PROMPT, 8, n=3))
    s.cancel(b)  # the other two need 12 + 3 = 15 blocks of the 16 free
    assert s.admit_waiting() == (a, c)
    assert s.sequence(c).waits_for == a
    s.cancel(holder)
    run_to_the_end(s)
    assert s.pool.statistics().held == 0


def test_a_group_of_one_is_a_plain_sequence() -> None:
    s = make(policy=Policy.PREEMPT, prefix_cache=True)
    (only,) = s.add_group(SequenceSpec(PROMPT, 4, n=1))
    assert s.admit_waiting() == (only,)
    assert s.sequence(only).waits_for is None


def test_an_heir_counts_as_cached_only_what_its_writer_had_written() -> None:
    s = make(chunk_tokens=8, prefix_cache=True)
    writer, heir, third = s.add_group(SequenceSpec(PROMPT, 4, n=3))
    s.admit_waiting()
    assert s.statistics().prefix_cache_hits_total == 0  # nothing is written yet
    run_step(s)
    run_step(s)  # the writer has committed 16 positions
    s.cancel(writer)
    # The heir computes positions 16..39 itself: only 16 were not computed again.
    assert s.sequence(heir).cached_tokens == 16
    assert s.sequence(third).cached_tokens == 36
    run_to_the_end(s)
    # Counted once each is written: the heir's 16, the third's 36 when the heir had them.
    assert s.statistics().prefix_cache_hits_total == 16 + 36


class Watching:
    """The reserve policy, noting how often each waiter it is shown was overtaken."""

    def __init__(self) -> None:
        self.inner = builtin(Policy.RESERVE)
        self.overtaken: dict[int, int] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def waiting_order(self, waiting: tuple[SeqView, ...]) -> tuple[int, ...]:
        self.overtaken.update({v.seq_id: v.overtaken for v in waiting})
        return self.inner.waiting_order(waiting)


def test_a_group_that_passes_an_older_waiter_counts_as_one_overtake() -> None:
    policy = Watching()
    s = make(num_blocks=18, policy=policy)
    holder = s.add(SequenceSpec([1] * 8, 8))  # 4 blocks, 14 left
    assert s.admit_waiting() == (holder,)
    big = s.add(SequenceSpec(PROMPT, 24))  # 16 blocks: it waits for the holder
    group = s.add_group(SequenceSpec([2] * 8, 4, n=3))  # 3 + 2 + 2 blocks: it fits, and passes big
    assert s.admit_waiting() == group
    s.admit_waiting()  # the policy is shown big again
    assert policy.overtaken[big] == 1


@pytest.mark.parametrize(("n", "room"), [(1, 24), (2, 16), (3, 8)])
def test_the_room_of_n_choices_is_the_largest_answer_the_door_lets_each_have(
    n: int, room: int
) -> None:
    s = make(num_blocks=20)  # 80 positions; the context is 64
    assert s.room(SequenceSpec(PROMPT, n=n)) == room
    s.add_group(SequenceSpec(PROMPT, room, n=n))
    with pytest.raises(Infeasible):
        s.add_group(SequenceSpec(PROMPT, room + 1, n=n))
