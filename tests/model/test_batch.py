"""The Batch: batch invariance, isolation between sequences, sampler state.

A tiny stand-in scheduler (:class:`Driver`) makes the plans: it hands each
sequence a block table from a shuffled free list (so tables are scattered
through the pool), feeds prompts in chunks, and appends sampled tokens. The real
Scheduler is another layer's; here only the mechanism is under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fixture_models import loaded

from triollm.batch import BadChunks, Batch
from triollm.model.kvstore import DEFAULT_KV_DTYPE, KVDtype
from triollm.model.loader import LoadedModel
from triollm.model.sampling import SamplingParams
from triollm.plan import ChunkPlan, StepPlan
from triollm.spec import GenerationSpec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
BLOCK = 8
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 400, n)]


@dataclass
class Seq:
    seq_id: int
    prompt: list[int]
    chunk: int  # prefill chunk size
    want: int  # tokens to generate
    params: SamplingParams = GREEDY
    starts_at: int = 0  # the step it arrives
    table: tuple[int, ...] = ()
    computed: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.want


class Driver:
    """Plans steps the way the contract says: prefill chunks first, then decode rows."""

    def __init__(self, batch: Batch, seqs: list[Seq], seed: int = 0) -> None:
        self.batch = batch
        self.seqs = seqs
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(batch.num_blocks)]
        self.step = 0

    def plan(self) -> StepPlan:
        prefills, decodes = [], []
        for s in self.seqs:
            if s.starts_at > self.step or s.done:
                continue
            if not s.table:  # arrive: reserve prompt + answer (+ one spare block)
                n_blocks = -(-(len(s.prompt) + s.want) // BLOCK) + 1
                s.table = tuple(self.free[:n_blocks])
                del self.free[:n_blocks]
                self.batch.add(s.seq_id, GenerationSpec(s.prompt, s.params))
            if s.computed < len(s.prompt):
                part = tuple(s.prompt[s.computed : s.computed + s.chunk])
                last = s.computed + len(part) == len(s.prompt)
                prefills.append(ChunkPlan(s.seq_id, part, s.computed, s.table, last, True))
            else:
                decodes.append(
                    ChunkPlan(s.seq_id, (s.tokens[-1],), s.computed, s.table, True, False)
                )
        return StepPlan(self.step, tuple(prefills + decodes))

    def run(self, max_steps: int = 400) -> None:
        by_id = {s.seq_id: s for s in self.seqs}
        while not all(s.done for s in self.seqs):
            assert self.step < max_steps, "driver did not finish"
            plan = self.plan()
            result = self.batch.run(plan)
            assert result.n_rows == plan.n_rows and result.step == self.step
            for chunk in plan.chunks:
                by_id[chunk.seq_id].computed += chunk.n_rows
            for token in result.sampled:
                s = by_id[token.seq_id]
                s.tokens.append(token.token_id)
                if s.done:
                    self.batch.remove(s.seq_id)
            self.step += 1


def run_alone(
    model: LoadedModel, s: Seq, poison: float | None = None, kv_dtype: KVDtype = DEFAULT_KV_DTYPE
) -> list[int]:
    batch = Batch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_dtype=kv_dtype)
    if poison is not None:
        batch.kv.k[:] = poison
        batch.kv.v[:] = poison
    alone = Seq(s.seq_id, s.prompt, chunk=len(s.prompt), want=s.want, params=s.params)
    Driver(batch, [alone], seed=99).run()
    return alone.tokens


def crowd(target: Seq) -> list[Seq]:
    """The target beside a long chunked prefill, early decoders, and a late arrival."""
    return [
        Seq(10, prompt(10, 90), chunk=7, want=5),  # prefilling in chunks while others decode
        Seq(11, prompt(11, 3), chunk=3, want=40),  # decoding from step 1 on
        target,
        Seq(12, prompt(12, 25), chunk=25, want=12, starts_at=6),  # arrives mid-run
        Seq(13, prompt(13, 50), chunk=16, want=8, starts_at=3),
    ]


@pytest.mark.parametrize(
    "name",
    [
        "llama-gqa-f32",
        "qwen3-headdim-f16",
        "mistral-window-f32",
        "qwen3-moe-f32",
        "mixtral-f16",
        "gemma3-window-f32",
        "phi3-longrope-f32",
    ],
)
def test_greedy_tokens_are_the_same_alone_and_in_a_ragged_batch(name: str) -> None:
    model = loaded(name)
    target = Seq(1, prompt(1, 70), chunk=16, want=32, starts_at=2)
    alone = run_alone(model, target)
    seqs = crowd(target)
    Driver(Batch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK), seqs).run()
    assert target.tokens == alone
    for s in seqs:  # and every neighbour got its own alone-answer too
        assert s.tokens == run_alone(model, s), s.seq_id


def test_a_seeded_sample_is_the_same_whatever_shares_the_batch() -> None:
    model = loaded("llama-tied-llama3-bf16")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    target = Seq(1, prompt(5, 40), chunk=9, want=24, params=params, starts_at=1)
    alone = run_alone(model, target)
    Driver(Batch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK), crowd(target)).run()
    assert target.tokens == alone
    assert len(set(alone)) > 3  # really sampled, not a constant


def test_positions_outside_a_sequence_are_never_read() -> None:
    """A pool full of NaN: unused blocks and the reserved tail of a table are never read.

    A float32 pool: NaN is a float32 value (16-bit caches widen NaN bits to a
    finite number, which would hide a read)."""
    model = loaded("qwen2-bias-f32")
    target = Seq(1, prompt(2, 33), chunk=33, want=20)
    poisoned = run_alone(model, target, poison=np.nan, kv_dtype=KVDtype.F32)
    assert poisoned == run_alone(model, target, kv_dtype=KVDtype.F32)


def test_a_neighbours_kv_cannot_reach_another_sequence() -> None:
    """Overwrite one sequence's blocks with garbage mid-run: the others' logits are
    bit-for-bit unchanged (same batch composition, so the same arithmetic)."""
    model = loaded("llama-gqa-f32")

    def run(poison_step: int | None) -> dict[int, list[np.ndarray]]:
        batch = Batch(model, num_blocks=NUM_BLOCKS, block_size=BLOCK)
        seqs = [Seq(i, prompt(i, 20 + 5 * i), chunk=8, want=10) for i in range(4)]
        driver = Driver(batch, seqs, seed=5)
        logits: dict[int, list[np.ndarray]] = {s.seq_id: [] for s in seqs}
        for _ in range(12):
            plan = driver.plan()
            if driver.step == poison_step:
                victim = seqs[2].table
                batch.kv.k[:, list(victim)] = 1e4
                batch.kv.v[:, list(victim)] = -1e4
            out = model.model.forward(plan.chunks, batch.kv)
            sampled = [c for c in plan.chunks if c.sample]
            for chunk, row in zip(sampled, out, strict=True):
                logits[chunk.seq_id].append(row.copy())
            for chunk in plan.chunks:
                seqs[chunk.seq_id].computed += chunk.n_rows
            for chunk, row in zip(sampled, out, strict=True):
                seqs[chunk.seq_id].tokens.append(int(np.argmax(row)))
            driver.step += 1
        return logits

    clean, poisoned = run(None), run(6)
    for seq_id in (0, 1, 3):
        assert len(clean[seq_id]) > 4
        for a, b in zip(clean[seq_id], poisoned[seq_id], strict=True):
            np.testing.assert_array_equal(a, b)
    # the victim itself did change: the poison was real
    assert not all(np.array_equal(a, b) for a, b in zip(clean[2], poisoned[2], strict=True))


def test_add_remove_and_sizes() -> None:
    model = loaded("llama-gqa-f32")
    batch = Batch(model, num_blocks=4, block_size=16)
    c = model.config
    per_value = {KVDtype.F16: 2, KVDtype.BF16: 2, KVDtype.F32: 4}[DEFAULT_KV_DTYPE]
    v_width = -(-c.head_dim // 32) * 32  # V is stored in whole panels of 32 columns
    assert (
        batch.kv_bytes_per_position
        == c.num_hidden_layers * c.num_key_value_heads * (c.head_dim + v_width) * per_value
    )
    assert batch.kv_bytes_total == batch.kv_bytes_per_position * 4 * 16
    q8 = Batch(model, num_blocks=4, block_size=16, kv_dtype=KVDtype.Q8_0)
    scales = -(-c.head_dim // 32) * 2  # one f16 scale per 32 values
    assert q8.kv_bytes_per_position == c.num_hidden_layers * c.num_key_value_heads * (
        c.head_dim + v_width + 2 * scales
    )
    assert q8.kv_bytes_total == q8.kv_bytes_per_position * 4 * 16
    batch.add(1, GenerationSpec([1, 2], GREEDY))
    with pytest.raises(ValueError, match="already"):
        batch.add(1, GenerationSpec([1, 2], GREEDY))
    assert 1 in batch and len(batch) == 1
    batch.remove(1)
    batch.remove(1)  # idempotent
    assert 1 not in batch
    plan = StepPlan(0, (ChunkPlan(1, (1, 2), 0, (0,), True, True),))
    with pytest.raises(ValueError, match="never added"):
        batch.run(plan)
    assert batch.run(StepPlan(3, ())).sampled == ()


def test_a_prefill_chunk_without_sample_returns_no_token() -> None:
    model = loaded("llama-gqa-f32")
    batch = Batch(model, num_blocks=4, block_size=16)
    batch.add(1, GenerationSpec([1, 2, 3], SamplingParams(temperature=0.0, logprobs=2)))
    first = batch.run(StepPlan(0, (ChunkPlan(1, (1, 2), 0, (3,), False, True),)))
    assert first.sampled == () and first.n_rows == 2 and first.seconds > 0
    second = batch.run(StepPlan(1, (ChunkPlan(1, (3,), 2, (3,), True, True),)))
    (token,) = second.sampled
    assert token.seq_id == 1 and token.logprob is not None and len(token.top_logprobs) == 2
    assert token.top_logprobs[0][0] == token.token_id


def test_a_bad_chunk_is_refused_by_name_before_anything_runs() -> None:
    """A token id past the model's vocabulary, or a block table too short for the
    chunk, is named with its sequence id (so the service fails that one alone) and
    nothing is computed: the good neighbour's next step gives the same token."""
    model = loaded("llama-gqa-f32")
    batch = Batch(model, num_blocks=4, block_size=16)
    for seq in (1, 2, 3):
        batch.add(seq, GenerationSpec([1, 2], GREEDY))
    vocab = model.config.vocab_size
    good = ChunkPlan(1, (1, 2), 0, (0,), True, True)
    past_vocab = ChunkPlan(2, (5, vocab), 0, (1,), True, True)
    short_table = ChunkPlan(3, tuple(range(5, 25)), 0, (2,), True, True)  # 20 rows, 16 positions
    with pytest.raises(BadChunks, match=str(vocab)) as info:
        batch.run(StepPlan(0, (good, past_vocab, short_table)))
    assert info.value.seq_ids == {2, 3}
    with pytest.raises(BadChunks) as info:
        batch.run(StepPlan(1, (ChunkPlan(2, (-1,), 0, (1,), True, True),)))
    assert info.value.seq_ids == {2}
    alone = Batch(model, num_blocks=4, block_size=16)
    alone.add(1, GenerationSpec([1, 2], GREEDY))
    expected = alone.run(StepPlan(0, (good,))).sampled[0].token_id
    assert batch.run(StepPlan(2, (good,))).sampled[0].token_id == expected
