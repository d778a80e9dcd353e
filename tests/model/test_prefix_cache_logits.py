"""A prefix-cache hit changes where a prefill starts, and nothing else.

The real Scheduler plans, the real model computes: a prompt whose opening is
found in the cache must give the same logits, bit for bit, as the same prompt
computed from scratch, for every fixture checkpoint, whether the first uncached
position is mid-prompt, one token before the end, or the prompt is an exact
number of blocks (then its last block is recomputed, scheduler rule 8).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixture_models import loaded as model

from triollm.batch import Batch
from triollm.model.loader import LoadedModel
from triollm.plan import SampledToken, StepResult
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.spec import SequenceSpec

MODELS = Path(__file__).resolve().parent.parent / "fixtures" / "models"
CHECKPOINTS = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").exists())
BLOCK = 8
OPENING = [int(t) for t in np.random.default_rng(7).integers(5, 400, 37)]  # 4 blocks + 5


class Run:
    """The Scheduler and a Batch's model, stepped by hand so the logits can be kept."""

    def __init__(self, loaded: LoadedModel, *, prefix_cache: bool) -> None:
        cfg = SchedulerConfig(
            num_blocks=24,
            block_size=BLOCK,
            slots=2,
            chunk_tokens=16,
            step_rows=32,
            context_tokens=96,
            prefix_cache=prefix_cache,
        )
        self.s = Scheduler(cfg)
        self.batch = Batch(loaded, num_blocks=cfg.num_blocks, block_size=BLOCK)

    def generate(self, prompt: list[int], n: int = 4, salt: str = "") -> tuple[int, np.ndarray]:
        """Greedy ``n`` tokens; returns (first prefill position, every sampled logits row)."""
        seq = self.s.add(SequenceSpec(prompt, n, cache_salt=salt))
        assert self.s.admit_waiting() == (seq,)
        start = self.s.sequence(seq).n_computed
        rows = []
        while seq in self.s.running_ids():
            plan = self.s.plan_step()
            self.batch.check(plan)
            logits = self.batch.model.forward(plan.chunks, self.batch.kv)  # (n_sampled, vocab)
            sampled = [c for c in plan.chunks if c.sample]
            tokens = []
            for chunk, row in zip(sampled, logits, strict=True):
                rows.append(row.copy())
                tokens.append(SampledToken(chunk.seq_id, int(np.argmax(row))))
            self.s.commit(StepResult(plan.step, tuple(tokens), plan.n_rows))
        return start, np.stack(rows)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize(
    ("prompt", "first_computed"),
    [
        ([*OPENING, 11, 12, 13], 32),  # mid-prompt: four blocks hit, 8 positions computed
        (OPENING[:33], 32),  # one token past a block boundary: only that token is computed
        (OPENING[:32], 24),  # exactly four blocks: the last block is recomputed, not shared
    ],
    ids=["hit-mid-prompt", "hit-to-the-last-token", "hit-ends-on-a-block-boundary"],
)
def test_a_cache_hit_gives_the_same_logits_bit_for_bit(
    name: str, prompt: list[int], first_computed: int
) -> None:
    loaded = model(name)
    start, cold = Run(loaded, prefix_cache=False).generate(prompt)
    assert start == 0
    warm = Run(loaded, prefix_cache=True)
    warm.generate(OPENING)  # leaves the opening's four full blocks cached
    start, hot = warm.generate(prompt)
    assert start == first_computed
    np.testing.assert_array_equal(hot, cold)  # logits of the prefill and of every decode
    assert [int(np.argmax(r)) for r in hot] == [int(np.argmax(r)) for r in cold]


def test_another_salt_finds_nothing_and_still_computes_the_same_answer() -> None:
    loaded = model(CHECKPOINTS[0])
    run = Run(loaded, prefix_cache=True)
    run.generate(OPENING, salt="tenant-a")
    start, other = run.generate(OPENING, salt="tenant-b")
    assert start == 0
    start, again = run.generate(OPENING, salt="tenant-a")
    assert start == 32
    np.testing.assert_array_equal(other, again)
