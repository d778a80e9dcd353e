"""Rule 9 of the Scheduler, the prefix cache: one sentence per test."""

from __future__ import annotations

from triollm.kv import prefix_hashes
from triollm.kvcache import BlockStored
from triollm.plan import Finished, SampledToken, StepPlan, StepResult
from triollm.scheduler import Policy, Scheduler, SchedulerConfig, SeqState
from triollm.spec import SequenceSpec

PROMPT = list(range(10, 30))  # 20 tokens: five full blocks of 4


def make(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_blocks=16, block_size=4, slots=4, chunk_tokens=8, step_rows=12, context_tokens=64
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def run_step(s: Scheduler) -> tuple[StepPlan, tuple[Finished, ...]]:
    """Plan one step and answer it like a Batch would (token 1 for every sample)."""
    plan = s.plan_step()
    if plan.is_empty:
        return plan, ()
    sampled = tuple(SampledToken(c.seq_id, 1) for c in plan.chunks if c.sample)
    return plan, s.commit(StepResult(plan.step, sampled, plan.n_rows))


def cached(**kw: object) -> Scheduler:
    return make(prefix_cache=True, **kw)


def run_to_end(s: Scheduler) -> None:
    while s.running_ids() or s.waiting_ids():
        s.admit_waiting()
        run_step(s)


def serve(s: Scheduler, prompt: list[int], max_tokens: int = 2, salt: str = "") -> int:
    """Admit ``prompt`` alone and plan its first step; return its seq_id (still prefilling)."""
    seq = s.add(SequenceSpec(prompt, max_tokens, cache_salt=salt))
    assert s.admit_waiting() == (seq,)
    return seq


def test_a_returning_prompt_prefills_only_past_its_cached_blocks() -> None:
    s = cached()
    serve(s, [*PROMPT, 1, 2])
    run_to_end(s)
    seq = serve(s, [*PROMPT, 7, 7, 7])  # 23 tokens: the first 20 are five cached blocks
    plan = s.plan_step()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.token_ids) == (20, (7, 7, 7))
    assert s.sequence(seq).cached_tokens == 20
    st = s.statistics()
    assert (st.prefix_cache_queries_total, st.prefix_cache_hits_total) == (22 + 23, 20)


def test_a_prompt_of_exactly_k_cached_blocks_recomputes_its_last_block() -> None:
    s = cached()
    serve(s, PROMPT)
    run_to_end(s)
    seq = serve(s, PROMPT)
    (chunk,) = s.plan_step().chunks
    assert (chunk.start, chunk.n_rows, chunk.sample) == (16, 4, True)
    assert s.sequence(seq).cached_tokens == 16


def test_only_the_opening_up_to_the_first_difference_is_shared() -> None:
    s = cached()
    serve(s, [*PROMPT, 1])
    run_to_end(s)
    other = [*PROMPT[:9], 99, *PROMPT[10:]]  # differs in block 2
    serve(s, [*other, 1])
    (chunk,) = s.plan_step().chunks
    assert chunk.start == 8  # blocks 0 and 1 hit; block 2 onwards is new, later ones too


def test_two_salts_never_share_a_block() -> None:
    s = cached()
    serve(s, [*PROMPT, 1], salt="tenant-a")
    run_to_end(s)
    b = serve(s, [*PROMPT, 1], salt="tenant-b")
    assert s.sequence(b).cached_tokens == 0
    a = serve(s, [*PROMPT, 1], salt="tenant-a")
    assert s.sequence(a).cached_tokens == 20
    assert not set(s.sequence(a).blocks) & set(s.sequence(b).blocks)


def test_two_live_sequences_share_a_block_through_its_refcount() -> None:
    s = cached()
    first = serve(s, [*PROMPT, 1], max_tokens=8)
    run_step(s)  # its prefill: 8 rows of chunk, then 8 ...
    run_step(s)
    run_step(s)
    second = serve(s, [*PROMPT, 5], max_tokens=8)
    shared = set(s.sequence(first).blocks) & set(s.sequence(second).blocks)
    assert len(shared) == 5
    assert all(s.pool.refcount(b) == 2 for b in shared)
    s.cancel(first)
    assert all(s.pool.refcount(b) == 1 for b in shared)  # the other holder keeps them
    assert s.state(second) is SeqState.PREFILLING


def test_a_finished_sequence_leaves_its_full_blocks_cached_and_free_to_take() -> None:
    s = cached(num_blocks=8)
    serve(s, [*PROMPT, 1], max_tokens=2)  # 23 positions: 6 blocks, 5 of them full
    run_to_end(s)
    st = s.statistics()
    assert (st.blocks_free, st.blocks_cached, st.blocks_held) == (8, 5, 0)
    # A request that shares nothing may take every block, cached ones included.
    seq = serve(s, [3] * 30, max_tokens=2)
    assert len(s.sequence(seq).blocks) == 8
    assert s.statistics().blocks_cached == 0


def test_reservation_counts_cached_blocks_and_the_hits_once() -> None:
    s = cached(num_blocks=8)
    serve(s, [*PROMPT, 1], max_tokens=2)
    run_to_end(s)
    # 21 + 11 = 32 positions = 8 blocks: 5 hit (cached) + 3 fresh of the 3 left.
    seq = serve(s, [*PROMPT, 1], max_tokens=11)
    assert s.sequence(seq).cached_tokens == 20 and s.statistics().blocks_free == 0


def test_a_preempted_sequence_finds_its_own_blocks_again() -> None:
    s = cached(num_blocks=6, policy=Policy.PREEMPT, preempt_watermark_blocks=0)
    old = s.add(SequenceSpec(list(range(1, 9)), 10))  # 2 blocks now, grows to 5
    young = s.add(SequenceSpec(list(range(40, 48)), 10))
    s.admit_waiting()
    for _ in range(12):
        run_step(s)
        if s.statistics().preemptions_total:
            break
    assert s.state(young) is SeqState.WAITING and s.statistics().preemptions_total == 1
    assert s.state(old) is SeqState.DECODING
    run_to_end(s)
    # The survivor's growth took the evicted one's blocks tail first (the LRU keeps a
    # table's opening longest), so its recompute still found at least its first block.
    assert s.statistics().prefix_cache_hits_total >= 4


def test_with_the_cache_off_nothing_is_hashed_shared_or_counted() -> None:
    s = make()
    serve(s, [*PROMPT, 1])
    run_to_end(s)
    serve(s, [*PROMPT, 1])
    (chunk,) = s.plan_step().chunks
    assert chunk.start == 0
    st = s.statistics()
    assert (st.blocks_cached, st.prefix_cache_queries_total, st.prefix_cache_hits_total) == (
        0,
        0,
        0,
    )


def test_a_block_is_published_only_after_the_step_that_wrote_it_commits() -> None:
    s = cached()
    seq = serve(s, [*PROMPT, 1])
    plan = s.plan_step()  # 8 rows: blocks 0 and 1, in flight
    table = s.sequence(seq).blocks
    assert s.pool.content(table[0]) is None  # not yet: the K/V is being written
    sampled = tuple(SampledToken(c.seq_id, 1) for c in plan.chunks if c.sample)
    s.commit(StepResult(plan.step, sampled, plan.n_rows))
    assert s.pool.content(table[0]) is not None and s.pool.content(table[2]) is None


def test_with_kv_events_each_commit_announces_the_blocks_it_filled_parent_first() -> None:
    s = cached(kv_events=True)
    serve(s, [*PROMPT, 1])  # 21 tokens: chunks of 8, 8 and 5 fill 2, 2 and 1 blocks
    stored = []
    while s.running_ids():
        run_step(s)
        stored += s.kv.drain_events()
    h = prefix_hashes([*PROMPT, 1], 4)
    assert stored == [
        BlockStored(h[0:2], None, tuple(PROMPT[0:8]), 4),
        BlockStored(h[2:4], h[1], tuple(PROMPT[8:16]), 4),
        BlockStored(h[4:5], h[3], tuple(PROMPT[16:20]), 4),
    ]
    quiet = cached()  # off unless asked for: nobody would drain them
    serve(quiet, [*PROMPT, 1])
    run_to_end(quiet)
    assert quiet.statistics().blocks_cached == 5 and quiet.kv.drain_events() == ()
