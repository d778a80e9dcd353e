"""Rule 11 of the Scheduler, a scored prompt (echo with logprobs): one sentence per test."""

from __future__ import annotations

import pytest

from triollm.plan import ChunkPlan, FinishReason, SampledToken, StepPlan, StepResult
from triollm.scheduler import Infeasible, Policy, Scheduler, SchedulerConfig, SeqState
from triollm.spec import SequenceSpec

PROMPT = list(range(10, 30))  # 20 tokens: five full blocks of 4


def make(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_blocks=16,
        block_size=4,
        slots=4,
        chunk_tokens=8,
        step_rows=12,
        context_tokens=64,
        prefix_cache=True,
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def run_step(s: Scheduler) -> StepPlan:
    """Plan one step and answer it like a Batch would (token 1 for every sample)."""
    plan = s.plan_step()
    if not plan.is_empty:
        sampled = tuple(SampledToken(c.seq_id, 1) for c in plan.chunks if c.sample)
        s.commit(StepResult(plan.step, sampled, plan.n_rows))
    return plan


def chunks_of(s: Scheduler, seq: int) -> list[ChunkPlan]:
    """Run until ``seq`` ends or decodes; its chunks, in order."""
    out = []
    while s.state(seq) in (SeqState.WAITING, SeqState.PREFILLING):
        s.admit_waiting()
        out += [c for c in run_step(s).chunks if c.seq_id == seq]
    return out


def warm(s: Scheduler, prompt: list[int]) -> None:
    """Serve ``prompt`` once, unscored, so its full blocks are in the cache."""
    seq = s.add(SequenceSpec(prompt, 2))
    while s.state(seq) not in (SeqState.FINISHED, SeqState.CANCELLED):
        s.admit_waiting()
        run_step(s)


def test_a_scored_prompt_takes_no_cache_hit_and_every_row_names_its_next_prompt_token() -> None:
    s = make()
    warm(s, PROMPT)
    seq = s.add(SequenceSpec(PROMPT, 3, score_prompt=True))
    chunks = chunks_of(s, seq)
    assert s.sequence(seq).cached_tokens == 0
    assert [c.start for c in chunks] == [0, 8, 16]
    scored = [t for c in chunks for t in c.score_ids]
    assert scored == PROMPT[1:]  # the last row predicts the answer's first token
    for c in chunks:  # row i predicts the token at start + i + 1
        assert c.score_ids == tuple(PROMPT[c.start + 1 : c.start + c.n_rows + 1])
    assert [c.sample for c in chunks] == [False, False, True]
    # The same prompt unscored still hits: only the scored request gives up the cache.
    other = s.add(SequenceSpec(PROMPT, 3))
    first = chunks_of(s, other)[0]
    assert (first.start, first.score_ids) == (16, ())


def test_a_scored_prompt_scores_nothing_once_it_decodes() -> None:
    s = make()
    seq = s.add(SequenceSpec(PROMPT[:6], 4, score_prompt=True))
    chunks_of(s, seq)
    while s.state(seq) is SeqState.DECODING:
        plan = run_step(s)
        assert all(not c.score_ids for c in plan.chunks)


def test_max_tokens_zero_is_refused_unless_the_prompt_is_scored() -> None:
    s = make()
    with pytest.raises(Infeasible) as refused:
        s.add(SequenceSpec(PROMPT, 0))
    assert refused.value.field == "max_tokens"
    assert s.feasible(len(PROMPT), 0) is not None
    s.add(SequenceSpec(PROMPT, 0, score_prompt=True))  # accepted


def test_a_scored_prompt_with_max_tokens_zero_ends_with_its_last_chunk_and_no_token() -> None:
    s = make()
    seq = s.add(SequenceSpec(PROMPT, 0, score_prompt=True))
    s.admit_waiting()
    assert len(s.sequence(seq).blocks) == 5  # the prompt's blocks: no answer reserved
    for _ in range(2):
        run_step(s)
    plan = s.plan_step()
    (last,) = plan.chunks
    assert (last.start, last.sample, last.score_ids) == (16, False, tuple(PROMPT[17:]))
    (done,) = s.commit(StepResult(plan.step, (), plan.n_rows))
    assert (done.seq_id, done.reason, done.n_generated) == (seq, FinishReason.LENGTH, 0)
    assert s.state(seq) is SeqState.FINISHED
    assert s.statistics().blocks_held == 0


def test_a_scored_prompt_preempted_before_its_first_token_is_scored_again() -> None:
    # A pool of 4 blocks: `old` (one block) and the scored `young` (three) fill it;
    # old's first decode row needs a block, so young is evicted after one chunk. Its
    # first block is published by then, and the cache would give it back: it may not.
    s = make(num_blocks=4, chunk_tokens=4, policy=Policy.PREEMPT, preempt_watermark_blocks=0)
    old = s.add(SequenceSpec(PROMPT[:4], 8))
    young = s.add(SequenceSpec(PROMPT[4:16], 4, score_prompt=True))
    assert s.admit_waiting() == (old, young)
    starts = [c.start for c in chunks_of(s, young)]
    assert s.sequence(young).preemptions == 1
    assert starts == [0, 0, 4, 8]
    assert s.state(old) is SeqState.FINISHED  # young came back once old gave its blocks back
