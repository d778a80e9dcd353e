"""The Scheduler's rules, one sentence per test (the rules are numbered in scheduler.py)."""

from __future__ import annotations

import pytest

from triollm.errors import FieldError
from triollm.plan import Finished, FinishReason, SampledToken, StepPlan, StepResult
from triollm.scheduler import (
    MIN_SERVING_CHUNK_TOKENS,
    MIN_SERVING_STALL_ROWS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    Infeasible,
    Policy,
    Scheduler,
    SchedulerConfig,
    SeqState,
    serving_chunk_tokens,
    serving_stall_rows,
)
from triollm.spec import SequenceSpec


def make(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_blocks=16, block_size=4, slots=4, chunk_tokens=8, step_rows=12, context_tokens=64
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def run_step(
    s: Scheduler, tokens: dict[int, int] | None = None
) -> tuple[StepPlan, tuple[Finished, ...]]:
    """Plan one step and answer it like a Batch would (token 1 unless told otherwise)."""
    plan = s.plan_step()
    if plan.is_empty:
        return plan, ()
    sampled = tuple(
        SampledToken(c.seq_id, (tokens or {}).get(c.seq_id, 1)) for c in plan.chunks if c.sample
    )
    return plan, s.commit(StepResult(plan.step, sampled, plan.n_rows))


def rows_of(plan: StepPlan) -> dict[int, int]:
    return {c.seq_id: c.n_rows for c in plan.chunks}


# -- rule 1: the door ----------------------------------------------------------------


def test_a_prompt_plus_max_tokens_past_the_context_is_refused_with_the_numbers() -> None:
    s = make(context_tokens=2048, num_blocks=100, block_size=32)
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([1] * 2000, 100))
    assert err.value.field == "max_tokens"
    assert str(err.value) == (
        "prompt (2000 tokens) + max_tokens (100) = 2100 exceeds the context of 2048 positions"
    )
    assert s.statistics().waiting == 0


def test_a_prompt_that_fills_the_context_blames_the_prompt() -> None:
    s = make(context_tokens=64)
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([1] * 64, None))
    assert err.value.field == "prompt"
    assert "64 positions" in str(err.value)


def test_a_request_bigger_than_the_whole_pool_is_refused_at_the_door() -> None:
    s = make(num_blocks=4, block_size=4, context_tokens=64)  # 16 positions in all
    assert s.feasible(10, 6) is None
    reason = s.feasible(10, 7)
    assert reason is not None and "need 5 blocks of 4" in reason and "has 4" in reason
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([1] * 10, 7))
    assert err.value.field == "max_tokens"
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([1] * 17, 1))
    assert err.value.field == "prompt"


def test_an_unset_max_tokens_the_pool_cannot_hold_blames_max_tokens() -> None:
    s = make(num_blocks=4, block_size=4, context_tokens=64)
    with pytest.raises(Infeasible) as err:
        s.add(
            SequenceSpec([1] * 5, None)
        )  # reserves the rest of the context: 64 positions, 16 blocks
    assert err.value.field == "max_tokens"
    assert "max_tokens (59 (unset: the rest of the context))" in str(err.value)


def test_an_empty_prompt_and_a_zero_max_tokens_are_refused() -> None:
    s = make()
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([], 4))
    assert err.value.field == "prompt"
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([1], 0))
    assert err.value.field == "max_tokens"


def test_a_priority_outside_32_bits_or_not_an_integer_is_refused_and_nothing_queues() -> None:
    s = make()
    for bad in (PRIORITY_MAX + 1, PRIORITY_MIN - 1, True, 1.5):
        with pytest.raises(FieldError) as err:
            s.add(SequenceSpec([1], 1, priority=bad))  # type: ignore[arg-type]
        assert err.value.field == "priority"
        assert f"between {PRIORITY_MIN} and {PRIORITY_MAX}" in str(err.value)
    assert s.statistics().waiting == 0
    edge = s.add(SequenceSpec([1], 1, priority=PRIORITY_MIN))
    assert s.sequence(edge).priority == PRIORITY_MIN


def test_no_max_tokens_means_the_rest_of_the_context() -> None:
    s = make(num_blocks=16, block_size=4, context_tokens=20)
    seq = s.add(SequenceSpec([1] * 6, None))
    assert s.sequence(seq).max_tokens == 14
    assert s.admit_waiting() == (seq,)
    assert len(s.sequence(seq).blocks) == 5  # ceil((6 + 14) / 4)


# -- rule 2: admission ---------------------------------------------------------------


def test_reserve_takes_prompt_and_answer_blocks_together() -> None:
    s = make(num_blocks=5, block_size=4)
    a = s.add(SequenceSpec([1] * 6, 6))  # ceil(12 / 4) = 3 blocks
    b = s.add(SequenceSpec([1] * 5, 3))  # 2 blocks
    c = s.add(SequenceSpec([1], 1))  # 1 block: does not fit after a and b
    assert s.admit_waiting() == (a, b)
    assert s.sequence(a).blocks == (0, 1, 2)
    assert s.state(c) is SeqState.WAITING
    assert s.statistics().blocks_free == 0


def test_admission_needs_a_free_slot() -> None:
    s = make(slots=2)
    ids = [s.add(SequenceSpec([1, 2], 2)) for _ in range(3)]
    assert s.admit_waiting() == tuple(ids[:2])
    assert s.admit_waiting() == ()
    s.cancel(ids[0])
    assert s.admit_waiting() == (ids[2],)


def test_growth_within_the_reservation_never_allocates() -> None:
    s = make(num_blocks=3, block_size=4)
    seq = s.add(SequenceSpec([1] * 3, 9))  # 12 positions: all 3 blocks up front
    s.admit_waiting()
    held = s.statistics().blocks_held
    finished: tuple[Finished, ...] = ()
    while not finished:
        _, finished = run_step(s)
        if not finished:
            assert s.statistics().blocks_held == held == 3
    assert finished == (Finished(seq, FinishReason.LENGTH, 9),)
    assert s.statistics().blocks_free == 3


# -- rule 3: FCFS with bounded overtaking ----------------------------------------------


def test_the_head_is_overtaken_at_most_k_times() -> None:
    s = make(num_blocks=8, block_size=4, slots=8, overtake_limit=2)
    big0 = s.add(SequenceSpec([1] * 4, 12))  # 4 blocks
    head = s.add(SequenceSpec([1] * 4, 16))  # 5 blocks: does not fit beside big0
    small = [s.add(SequenceSpec([1], 3)) for _ in range(3)]  # 1 block each
    assert s.admit_waiting() == (big0, small[0], small[1])
    # A slot and a block are free, yet the third small one waits behind the head.
    assert s.statistics().blocks_free == 2
    assert s.admit_waiting() == ()
    s.cancel(big0)
    assert s.admit_waiting() == (head, small[2])


def test_strict_fifo_admits_nobody_before_the_head() -> None:
    s = make(num_blocks=8, block_size=4, overtake_limit=0)
    s.add(SequenceSpec([1] * 4, 12))
    s.add(SequenceSpec([1] * 4, 16))
    s.add(SequenceSpec([1], 3))
    assert len(s.admit_waiting()) == 1


# -- rule 4: step composition ----------------------------------------------------------


def test_the_prompt_is_chunked_and_only_the_final_chunk_samples() -> None:
    s = make(chunk_tokens=8, step_rows=12)
    seq = s.add(SequenceSpec(list(range(20)), 2))
    s.admit_waiting()
    spans = []
    for _ in range(3):
        plan, _ = run_step(s)
        (c,) = plan.chunks
        spans.append((c.start, c.n_rows, c.sample, c.prefill))
        assert c.token_ids == tuple(range(c.start, c.start + c.n_rows))
    assert spans == [(0, 8, False, True), (8, 8, False, True), (16, 4, True, True)]
    assert s.state(seq) is SeqState.DECODING
    plan, _ = run_step(s)
    assert plan.chunks[0].prefill is False and plan.chunks[0].start == 20


def test_prefill_goes_before_decode_when_rows_are_scarce() -> None:
    for step_rows, expected in [(4, (4, 0)), (6, (4, 2))]:
        s = make(chunk_tokens=8, step_rows=step_rows, slots=4)
        old = [s.add(SequenceSpec([1], 8)) for _ in range(3)]
        s.admit_waiting()
        run_step(s)  # the three one-token prompts get their first tokens
        new = s.add(SequenceSpec([1] * 4, 2))
        s.admit_waiting()
        plan, _ = run_step(s)
        rows = rows_of(plan)
        prefill_rows = rows.pop(new)
        assert (prefill_rows, sum(rows.values())) == expected
        assert set(rows) <= set(old)
        assert [c.prefill for c in plan.chunks] == [True] + [False] * len(rows)


def test_a_wave_of_prompts_shares_one_chunk_while_anyone_decodes() -> None:
    # The served c=8 wave: one prompt arrives first and decodes while seven more
    # prefill. The chunk bounds the step's prefill (the decoders' stall), not each
    # prompt's, so every step carries at most one chunk and every decoder its row.
    s = make(num_blocks=64, slots=8, chunk_tokens=8, step_rows=16)
    first = s.add(SequenceSpec(list(range(8)), 20))
    s.admit_waiting()
    plan, _ = run_step(s)
    assert rows_of(plan) == {first: 8}  # nobody decodes: the whole chunk at once
    wave = [s.add(SequenceSpec(list(range(8)), 20)) for _ in range(7)]
    s.admit_waiting()
    decoding = {first}
    while any(s.sequence(q).n_generated == 0 for q in wave):
        plan, _ = run_step(s)
        rows = rows_of(plan)
        prefill = sum(c.n_rows for c in plan.chunks if c.prefill)
        assert prefill <= 8, f"step {plan.step}: {prefill} prefill rows beside decoders"
        assert decoding <= set(rows), f"step {plan.step} left out {decoding - set(rows)}"
        decoding |= {q for q in wave if s.sequence(q).n_generated > 0}
    # An idle step (nothing decodes) is not bounded by the chunk: two prompts fill it.
    t = make(num_blocks=64, slots=8, chunk_tokens=8, step_rows=16)
    pair = [t.add(SequenceSpec(list(range(8)), 2)) for _ in range(2)]
    t.admit_waiting()
    plan, _ = run_step(t)
    assert rows_of(plan) == {pair[0]: 8, pair[1]: 8}


def test_the_stall_budget_bounds_prefill_beside_decoders_and_idle_steps_keep_the_chunk() -> None:
    # stall_rows below the chunk: beside a decoder a step carries at most 3 prefill
    # rows (the decoders' stall), spread over the prompts in admission order; a step
    # with nobody decoding stalls nobody and takes the whole chunk.
    s = make(num_blocks=64, slots=4, chunk_tokens=8, stall_rows=3, step_rows=12)
    first = s.add(SequenceSpec(list(range(8)), 20))
    s.admit_waiting()
    plan, _ = run_step(s)
    assert rows_of(plan) == {first: 8}  # idle: the full chunk, one step to a first token
    wave = [s.add(SequenceSpec(list(range(5)), 20)) for _ in range(2)]
    s.admit_waiting()
    plan, _ = run_step(s)
    assert rows_of(plan) == {wave[0]: 3, first: 1}
    plan, _ = run_step(s)
    assert rows_of(plan) == {wave[0]: 2, wave[1]: 1, first: 1}  # the budget is shared
    while s.sequence(wave[1]).n_generated == 0:
        plan, _ = run_step(s)
        prefill = sum(c.n_rows for c in plan.chunks if c.prefill)
        assert prefill <= 3, f"step {plan.step}: {prefill} prefill rows beside decoders"
        assert first in rows_of(plan)


def test_a_stall_budget_past_the_chunk_is_refused_and_unset_it_is_the_chunk() -> None:
    with pytest.raises(ValueError, match=r"stall_rows \(9\) must be <= chunk_tokens \(8\)"):
        SchedulerConfig(num_blocks=4, chunk_tokens=8, stall_rows=9)
    with pytest.raises(ValueError, match="stall_rows must be an integer >= 1, got 0"):
        SchedulerConfig(num_blocks=4, chunk_tokens=8, stall_rows=0)
    assert SchedulerConfig(num_blocks=4, chunk_tokens=8).stall_rows == 8


def test_a_chunk_rides_with_decodes_in_one_step() -> None:
    s = make(chunk_tokens=8, step_rows=12)
    decoders = [s.add(SequenceSpec([1, 2], 5)) for _ in range(3)]
    s.admit_waiting()
    run_step(s)
    prompt = s.add(SequenceSpec(list(range(8)), 2))
    s.admit_waiting()
    plan, _ = run_step(s)
    assert [(c.seq_id, c.n_rows) for c in plan.chunks] == [(prompt, 8)] + [(d, 1) for d in decoders]
    assert plan.n_rows == 11


def test_a_left_out_sequence_is_not_evicted() -> None:
    s = make(chunk_tokens=8, step_rows=4, slots=4)
    old = s.add(SequenceSpec([1], 8))
    s.admit_waiting()
    run_step(s)
    blocks = s.sequence(old).blocks
    new = [s.add(SequenceSpec([1] * 8, 2)) for _ in range(2)]
    s.admit_waiting()
    plan, _ = run_step(s)
    assert old not in rows_of(plan)
    assert s.state(old) is SeqState.DECODING and s.sequence(old).blocks == blocks
    # ...and "wait for the next step" is a promise: it goes first next time.
    plan, _ = run_step(s)
    assert rows_of(plan)[old] == 1
    del new


# -- rule 6: cancellation --------------------------------------------------------------


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding"])
def test_cancelled_sequence_returns_its_blocks_before_next_plan(where: str) -> None:
    s = make(num_blocks=4, block_size=4, slots=1)
    seq = s.add(SequenceSpec([1] * 10, 6))  # 4 blocks: the whole pool
    if where != "waiting":
        s.admit_waiting()
        run_step(s)  # 8 of 10 prompt positions
        if where == "decoding":
            run_step(s)
    assert s.state(seq).value == where
    s.cancel(seq)
    s.cancel(seq)  # idempotent
    assert s.state(seq) is SeqState.CANCELLED
    assert s.statistics().blocks_free == 4 and s.statistics().free_slots == 1
    assert s.plan_step().is_empty


def test_a_result_for_a_sequence_cancelled_mid_step_is_ignored() -> None:
    s = make()
    a = s.add(SequenceSpec([1, 2], 4))
    b = s.add(SequenceSpec([1, 2], 4))
    s.admit_waiting()
    plan = s.plan_step()
    s.cancel(a)  # the client left while the Batch ran
    sampled = tuple(SampledToken(c.seq_id, 1) for c in plan.chunks)
    s.commit(StepResult(plan.step, sampled))
    assert s.state(a) is SeqState.CANCELLED
    assert s.sequence(b).n_generated == 1
    assert s.statistics().blocks_held == len(s.sequence(b).blocks)


def test_a_stop_token_finishes_with_stop_and_max_tokens_with_length() -> None:
    s = make()
    a = s.add(SequenceSpec([1, 2], 5, stop_token_ids=frozenset({99})))
    b = s.add(SequenceSpec([1, 2], 1))
    s.admit_waiting()
    _, fin = run_step(s, {a: 3})
    assert fin == (Finished(b, FinishReason.LENGTH, 1),)
    _, fin = run_step(s, {a: 99})
    assert fin == (Finished(a, FinishReason.STOP, 2),)
    assert s.statistics().blocks_held == 0


def test_finish_ends_a_sequence_early_and_frees_its_blocks() -> None:
    s = make()
    a = s.add(SequenceSpec([1, 2], 5))
    s.admit_waiting()
    run_step(s)
    s.finish(a)
    assert s.state(a) is SeqState.FINISHED
    assert s.statistics().blocks_held == 0 and s.statistics().finished_total == 1


# -- static, free-slot, preempt ----------------------------------------------------------


def test_static_starts_a_new_batch_only_when_the_whole_last_one_ended() -> None:
    s = make(policy=Policy.STATIC)
    a = s.add(SequenceSpec([1], 1))
    b = s.add(SequenceSpec([1], 3))
    s.admit_waiting()
    run_step(s)  # a ends, b goes on
    c = s.add(SequenceSpec([1], 1))
    assert s.admit_waiting() == ()  # a slot is free, but the batch is closed
    run_step(s)
    run_step(s)
    assert s.state(b) is SeqState.FINISHED
    assert s.admit_waiting() == (c,)
    del a


def test_free_slot_deadlock_is_detected_and_reported() -> None:
    s = make(policy=Policy.FREE_SLOT, num_blocks=4, block_size=4, slots=2, step_rows=16)
    a = s.add(SequenceSpec([1] * 7, 8))  # prompt: 2 blocks; the whole answer would need 4
    b = s.add(SequenceSpec([1] * 7, 8))
    assert s.admit_waiting() == (a, b)  # the pool is full of prompts
    run_step(s)  # both prefill; both now need a third block to decode at position 8
    run_step(s)  # position 7 still fits
    plan = s.plan_step()
    assert plan.is_empty
    st = s.statistics()
    assert st.deadlocked and st.running == 2 and st.blocks_free == 0
    report = s.deadlock_report()
    assert report is not None
    assert [(h.seq_id, len(h.blocks), h.blocks_needed) for h in report.holders] == [
        (a, 2, 1),
        (b, 2, 1),
    ]
    assert "needs 1 more" in report.describe()
    s.cancel(b)  # something outside freed blocks: no longer a deadlock
    assert not s.statistics().deadlocked
    assert not s.plan_step().is_empty


def tight_preempt() -> Scheduler:
    """Two slots over a 4-block pool of 4 positions: two 7-token prompts that each
    grow past their second block cannot both fit, so the later one is preempted."""
    return make(
        policy=Policy.PREEMPT,
        num_blocks=4,
        block_size=4,
        slots=2,
        step_rows=16,
        preempt_watermark_blocks=0,
    )


def test_preempt_evicts_the_latest_arrival_and_recomputes_its_tokens() -> None:
    s = tight_preempt()
    a = s.add(SequenceSpec([1] * 7, 8))
    b = s.add(SequenceSpec([2] * 7, 8))
    assert s.admit_waiting() == (a, b)
    run_step(s, {a: 10, b: 20})
    run_step(s, {a: 11, b: 21})
    plan, _ = run_step(s, {a: 12})  # a needs block 3; b, the later arrival, is evicted
    assert s.state(b) is SeqState.WAITING and s.sequence(b).blocks == ()
    assert s.sequence(b).preemptions == 1 and s.sequence(b).ticket == b
    assert rows_of(plan) == {a: 1}
    assert s.statistics().preemptions_total == 1
    while a in s.running_ids():
        run_step(s)
    # b comes back at its original ticket and recomputes prompt + generated tokens;
    # the last recomputed chunk samples its next token.
    plan, _ = run_step(s)
    assert [(c.seq_id, c.start, c.n_rows, c.sample, c.prefill) for c in plan.chunks] == [
        (b, 0, 8, False, True)
    ]
    plan, _ = run_step(s, {b: 22})
    assert [(c.start, c.token_ids, c.sample, c.prefill) for c in plan.chunks] == [
        (8, (21,), True, True)
    ]
    assert s.token_ids(b) == (2, 2, 2, 2, 2, 2, 2, 20, 21, 22)


def test_a_preempted_sequence_keeps_its_place_ahead_of_newer_arrivals() -> None:
    s = tight_preempt()
    a = s.add(SequenceSpec([1] * 7, 8))
    b = s.add(SequenceSpec([2] * 7, 8))
    s.admit_waiting()
    for _ in range(3):
        run_step(s)
    assert s.state(b) is SeqState.WAITING
    late = s.add(SequenceSpec([3], 1))
    assert s.waiting_ids() == (b, late)  # b kept its earlier ticket: it is the head
    del a


def test_an_idle_scheduler_admits_even_right_after_a_preemption() -> None:
    s = tight_preempt()
    a = s.add(SequenceSpec([1] * 7, 3))
    b = s.add(SequenceSpec([2] * 7, 8))
    s.admit_waiting()
    run_step(s)
    run_step(s)
    _, finished = run_step(s)  # a needs a block, evicts b, and finishes in the same step
    assert [f.seq_id for f in finished] == [a]
    assert s.state(b) is SeqState.WAITING and not s.running_ids()
    # "No admission after a preempting step" must not strand b: nothing else will run.
    assert s.admit_waiting() == (b,)


# -- the loop's contract ---------------------------------------------------------------


def test_a_second_plan_is_refused_while_one_is_in_flight() -> None:
    s = make()
    s.add(SequenceSpec([1], 2))
    s.admit_waiting()
    s.plan_step()
    with pytest.raises(RuntimeError, match="in flight"):
        s.plan_step()
    s.discard_step()
    assert not s.plan_step().is_empty


def test_a_block_freed_mid_step_is_rewritten_by_its_new_owner_before_it_is_read() -> None:
    """Rule 6's hazard: A's step is in flight (a worker thread writes A's K/V into
    its blocks) when A's client leaves; B is admitted onto the same blocks. B must
    not be planned until A's step is over, and B's first chunk must write every
    position it will read."""
    s = make(num_blocks=2, block_size=4, slots=2)
    a = s.add(SequenceSpec([1] * 4, 4))  # 8 positions: both blocks
    s.admit_waiting()
    plan = s.plan_step()
    a_blocks = set(s.sequence(a).blocks)
    s.cancel(a)  # mid-step: the blocks are back at once
    b = s.add(SequenceSpec([2] * 3, 1))
    assert s.admit_waiting() == (b,)
    assert set(s.sequence(b).blocks) <= a_blocks  # reused while A's write may still land
    with pytest.raises(RuntimeError, match="in flight"):
        s.plan_step()  # a second plan would let B's step race A's write
    assert s.commit(StepResult(plan.step, (SampledToken(a, 1),), plan.n_rows)) == ()
    (chunk,) = s.plan_step().chunks
    assert (chunk.seq_id, chunk.start, chunk.n_rows) == (b, 0, 3)  # writes 0..2 first


def test_a_result_missing_a_sampled_token_is_refused_and_changes_nothing() -> None:
    s = make()
    a = s.add(SequenceSpec([1], 2))
    s.admit_waiting()
    plan = s.plan_step()
    with pytest.raises(ValueError, match="sampled no token"):
        s.commit(StepResult(plan.step, ()))
    with pytest.raises(ValueError, match="step 99"):
        s.commit(StepResult(99, ()))
    s.commit(StepResult(plan.step, (SampledToken(a, 5),)))
    assert s.token_ids(a) == (1, 5)


def test_statistics_are_a_frozen_snapshot() -> None:
    import dataclasses

    s = make(slots=2, num_blocks=16)
    for _ in range(3):
        s.add(SequenceSpec([1] * 5, 3))  # 2 blocks each
    s.admit_waiting()
    st = s.statistics()
    assert (st.waiting, st.running, st.free_slots, st.prefilling) == (1, 2, 0, 2)
    assert (st.blocks_total, st.blocks_held, st.blocks_free) == (16, 4, 12)
    assert st.policy is Policy.RESERVE and not st.deadlocked and st.step == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.waiting = 0  # type: ignore[misc]
    run_step(s)
    assert s.statistics().step == 1 and st.step == 0  # the old snapshot did not move


def test_an_unknown_sequence_is_a_key_error() -> None:
    s = make()
    with pytest.raises(KeyError):
        s.state(3)
    with pytest.raises(KeyError):
        s.cancel(3)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_blocks", 0), ("block_size", 0), ("slots", 0), ("chunk_tokens", 0), ("step_rows", 2)],
)
def test_a_bad_config_names_the_field(field: str, value: int) -> None:
    kw: dict[str, object] = dict(num_blocks=8, slots=4, step_rows=8)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)  # type: ignore[arg-type]


def test_a_policy_may_be_named_by_its_value() -> None:
    assert SchedulerConfig(num_blocks=4, policy="free-slot").policy is Policy.FREE_SLOT  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(num_blocks=4, policy="lifo")  # type: ignore[arg-type]


SMOLLM2_ROW_WEIGHTS = 106_168_320  # 30 layers of 576 wide, 9 heads / 3 KV heads, MLP 1536
QWEN_1_5B_ROW_WEIGHTS = 1_310_195_712  # 28 layers of 1536 wide, 12 / 2 heads, MLP 8960


def test_the_serving_chunk_shrinks_as_the_model_grows_down_to_one_short_prompt() -> None:
    assert serving_chunk_tokens(SMOLLM2_ROW_WEIGHTS) == 128  # where 128 was measured
    assert serving_chunk_tokens(1_000) == 128  # a tiny model: never past the measured 128
    assert serving_chunk_tokens(2 * 106_000_000) == 64  # twice the weights, half the rows
    assert serving_chunk_tokens(QWEN_1_5B_ROW_WEIGHTS) == MIN_SERVING_CHUNK_TOKENS == 32
    assert serving_chunk_tokens(70_000_000_000) == 32  # a 32-token prompt stays one chunk
    chunks = [serving_chunk_tokens(w) for w in range(10**6, 3 * 10**9, 10**7)]
    assert chunks == sorted(chunks, reverse=True)
    assert {c & (c - 1) for c in chunks} == {0}  # powers of two
    with pytest.raises(ValueError, match="row_weights"):
        serving_chunk_tokens(0)


def test_the_serving_stall_budget_follows_the_bytes_per_weight_within_the_chunk() -> None:
    # The files the budget was measured on (bytes as loaded): ~one decode step of rows.
    assert serving_stall_rows(QWEN_1_5B_ROW_WEIGHTS, 1_111_599_616, 32) == 16  # Q4_K_M
    assert serving_stall_rows(SMOLLM2_ROW_WEIGHTS, 96_576_768, 128) == 16  # Q4_1
    assert serving_stall_rows(SMOLLM2_ROW_WEIGHTS, 269_100_288, 128) == 32  # bf16: 2.5 B/w
    # Never past the chunk (a chunk is the most one prompt takes), never below the floor
    # unless the chunk itself is.
    assert serving_stall_rows(SMOLLM2_ROW_WEIGHTS, 4 * SMOLLM2_ROW_WEIGHTS, 32) == 32
    assert serving_stall_rows(SMOLLM2_ROW_WEIGHTS, 1_000, 128) == MIN_SERVING_STALL_ROWS == 8
    assert serving_stall_rows(SMOLLM2_ROW_WEIGHTS, 1_000, 4) == 4
    stalls = [serving_stall_rows(10**8, b, 128) for b in range(10**7, 10**9, 10**7)]
    assert stalls == sorted(stalls) and {c & (c - 1) for c in stalls} == {0}
    with pytest.raises(ValueError, match="weight_bytes"):
        serving_stall_rows(10**8, 0, 32)
