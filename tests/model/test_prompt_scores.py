"""Prompt scoring in the Batch (``ChunkPlan.score_ids``, what echo with logprobs asks).

Every scored row's log-probability is checked against the one path that existed
before it: logits that are *sampled* (the prompt fed one token per step, each
step's last row through the head), then an independent float64 log-softmax. And,
where torch is installed (the ``fixtures`` extra), against transformers computing
every position of the prompt at once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixture_models import loaded

from triollm import batch as batch_module
from triollm.batch import BadChunks, Batch
from triollm.kv import blocks_for
from triollm.model.kvstore import KVDtype
from triollm.model.loader import LoadedModel
from triollm.model.sampling import SamplingParams, log_softmax
from triollm.plan import ChunkPlan, PromptScores, SampledToken, StepPlan
from triollm.spec import GenerationSpec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL_NAMES = sorted(p.name for p in (FIXTURES / "models").iterdir())
F32 = KVDtype.F32  # every Batch here: scores are compared at TOL
BLOCK = 8
# Scored rows and sampled rows are the same float32 hidden states through the same
# head, but a chunk's rows and one-row steps run attention in other orders: measured
# differences ~1e-6 on these models (logits of magnitude ~1-10).
TOL = 1e-4


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 390, n)]


def table_for(n: int, first: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + blocks_for(n, BLOCK)))


def scored_chunks(seq_id: int, ids: list[int], chunk: int, table: tuple[int, ...], sample: bool):
    """The chunks of a scored prompt: row i of a chunk predicts the next prompt token."""
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        yield ChunkPlan(
            seq_id,
            tuple(ids[start:end]),
            start,
            table,
            sample=sample and end == len(ids),
            prefill=True,
            score_ids=tuple(ids[start + 1 : end + 1]),
        )


def score(model: LoadedModel, ids: list[int], chunk: int, top_n: int = 0) -> list[PromptScores]:
    """Score ``ids`` alone in chunks of ``chunk`` rows (max_tokens 0: nothing sampled).

    float32 KV cache here and below: these scores are held to transformers' and to
    each other at TOL, which a 16-bit cache's rounding would exceed."""
    batch = Batch(model, num_blocks=blocks_for(len(ids), BLOCK), block_size=BLOCK, kv_dtype=F32)
    batch.add(0, GenerationSpec(ids, SamplingParams(temperature=0.0, logprobs=top_n)))
    out = []
    for step, c in enumerate(scored_chunks(0, ids, chunk, table_for(len(ids)), sample=False)):
        result = batch.run(StepPlan(step, (c,)))
        assert result.sampled == ()
        (scores,) = result.scores
        assert (scores.seq_id, scores.first) == (0, c.start + 1)
        assert len(scores.logprobs) == len(scores.top) == len(c.score_ids)
        out.append(scores)
    return out


def flat(scores: list[PromptScores]) -> tuple[np.ndarray, list]:
    lps = np.array([lp for s in scores for lp in s.logprobs])
    return lps, [t for s in scores for t in s.top]


def sampled_logits(model: LoadedModel, ids: list[int]) -> np.ndarray:
    """The logits after each prefix of ``ids`` the way a decode step gets them: one
    token per step, the row sampled. ``(len(ids) - 1, vocab)`` float32."""
    batch = Batch(model, num_blocks=blocks_for(len(ids), BLOCK), block_size=BLOCK, kv_dtype=F32)
    table = table_for(len(ids))
    rows = []
    for p in range(len(ids) - 1):
        c = ChunkPlan(0, (ids[p],), p, table, sample=True, prefill=p == 0)
        rows.append(model.model.forward([c], batch.kv)[0])
    return np.stack(rows)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prompt_logprobs_are_the_log_softmax_of_each_position_s_sampled_logits(name: str) -> None:
    model = loaded(name)
    ids = prompt(3, 150)  # chunks of 100 rows: two slices of the head (64 + 36)
    assert batch_module.SCORE_SLICE_ROWS < 100
    lps, tops = flat(score(model, ids, chunk=100, top_n=5))
    logits = sampled_logits(model, ids)
    want = np.array([log_softmax(row)[t] for row, t in zip(logits, ids[1:], strict=True)])
    assert lps.shape == (len(ids) - 1,)
    np.testing.assert_allclose(lps, want, rtol=0, atol=TOL)
    for row, top in zip(logits, tops, strict=True):
        ref = log_softmax(row)
        best = np.argsort(-ref, kind="stable")[:5]
        assert [i for i, _ in top] == [int(i) for i in best] or np.min(np.diff(-ref[best])) < TOL
        np.testing.assert_allclose([lp for _, lp in top], ref[[i for i, _ in top]], atol=TOL)


def test_chunk_boundaries_do_not_change_what_a_row_scores() -> None:
    """The last row of a non-final chunk predicts the next chunk's first token."""
    model = loaded("llama-gqa-f32")
    ids = prompt(4, 45)
    one, _ = flat(score(model, ids, chunk=45))
    many, _ = flat(score(model, ids, chunk=7))
    np.testing.assert_allclose(many, one, rtol=0, atol=TOL)


def test_a_greedy_continuation_scores_what_the_decode_path_gave_each_token() -> None:
    """lm-eval's loglikelihood: the sum of the continuation's token_logprobs is the
    sum the decode path reported while generating it greedily."""
    model = loaded("llama-tied-llama3-bf16")
    ids = prompt(5, 30)
    n = 12
    batch = Batch(model, num_blocks=blocks_for(len(ids) + n, BLOCK), block_size=BLOCK, kv_dtype=F32)
    batch.add(0, GenerationSpec(ids, SamplingParams(temperature=0.0, logprobs=1)))
    table = table_for(len(ids) + n)
    chunk = ChunkPlan(0, tuple(ids), 0, table, sample=True, prefill=True)
    generated: list[SampledToken] = []
    for step in range(n):
        (tok,) = batch.run(StepPlan(step, (chunk,))).sampled
        generated.append(tok)
        chunk = ChunkPlan(0, (tok.token_id,), len(ids) + step, table, True, False)
    full = ids + [t.token_id for t in generated]
    lps, tops = flat(score(model, full, chunk=16, top_n=1))
    continuation = lps[len(ids) - 1 :]  # the entries of positions len(ids) ..
    decoded = np.array([t.logprob for t in generated])
    np.testing.assert_allclose(continuation, decoded, rtol=0, atol=TOL)
    assert abs(continuation.sum() - decoded.sum()) < n * TOL
    # Greedy: each continuation token is its position's best, with the very same value
    # (lm-eval's is_greedy compares the two for equality).
    for lp, top, tok in zip(continuation, tops[len(ids) - 1 :], generated, strict=True):
        assert top[0] == (tok.token_id, lp)


def run_neighbour(model: LoadedModel, beside: str) -> list[SampledToken]:
    """A seeded, logprob-returning neighbour B over 14 steps, beside request A's prompt
    (``beside``: "none", "plain" or "scored"). B's tokens, with their logprobs."""
    batch = Batch(model, num_blocks=40, block_size=BLOCK, kv_dtype=F32)
    b_ids, a_ids = prompt(8, 21), prompt(9, 60)
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=77, logprobs=5)
    batch.add(1, GenerationSpec(b_ids, params))
    if beside != "none":
        batch.add(2, GenerationSpec(a_ids, SamplingParams(temperature=0.0, logprobs=3)))
    b_table, a_table = table_for(40), table_for(70, first=10)
    a_chunks = list(scored_chunks(2, a_ids, 13, a_table, sample=True))
    if beside == "plain":
        a_chunks = [
            ChunkPlan(c.seq_id, c.token_ids, c.start, c.block_table, c.sample, True)
            for c in a_chunks
        ]
    b_chunks = list(scored_chunks(1, b_ids, 8, b_table, sample=True))
    b_chunks = [
        ChunkPlan(c.seq_id, c.token_ids, c.start, c.block_table, c.sample, True) for c in b_chunks
    ]
    got: list[SampledToken] = []
    a_next: ChunkPlan | None = None
    a_got = 0
    for step in range(14):
        chunks = []
        if beside != "none":
            if a_chunks:
                chunks.append(a_chunks.pop(0))
            elif a_next is not None:
                chunks.append(a_next)
        if b_chunks:
            chunks.insert(0, b_chunks.pop(0))
        else:
            pos = len(b_ids) + len(got) - 1
            chunks.append(ChunkPlan(1, (got[-1].token_id,), pos, b_table, True, False))
        result = batch.run(StepPlan(step, tuple(chunks)))
        assert bool(result.scores) == (beside == "scored" and step < 5)
        for tok in result.sampled:
            if tok.seq_id == 1:
                got.append(tok)
            else:
                a_got += 1
                pos = len(a_ids) + a_got - 1  # where the token just sampled is fed
                a_next = ChunkPlan(2, (tok.token_id,), pos, a_table, True, False)
    return got


def test_a_neighbour_s_tokens_and_logprobs_are_bit_identical_beside_a_scored_prompt() -> None:
    """Scoring A's prompt changes nothing for B: the same steps with A's rows scored or
    not give B the same tokens and logprobs, float for float. (Beside A or alone, B's
    seeded tokens are the same too; its logprobs then differ in the last bits, ~1e-6,
    because the rows' products run at another batch width: test_batch.py's
    invariance is of tokens, and of bits only for the same composition.)"""
    model = loaded("llama-gqa-f32")
    alone = run_neighbour(model, "none")
    plain = run_neighbour(model, "plain")
    scored = run_neighbour(model, "scored")
    assert len(alone) >= 10 and len({t.token_id for t in alone}) > 3
    assert scored == plain  # ids, logprobs and top-5, float for float
    assert [t.token_id for t in scored] == [t.token_id for t in alone]


def test_a_chunk_with_bad_score_ids_is_refused_before_anything_runs() -> None:
    model = loaded("llama-gqa-f32")
    batch = Batch(model, num_blocks=4, block_size=BLOCK, kv_dtype=F32)
    batch.add(0, GenerationSpec([5, 6, 7], SamplingParams(temperature=0.0)))
    table = table_for(3)
    too_many = ChunkPlan(0, (5, 6), 0, table, False, True, score_ids=(6, 7, 8))
    outside = ChunkPlan(0, (5, 6), 0, table, False, True, score_ids=(6, 10**6))
    for bad in (too_many, outside):
        with pytest.raises(BadChunks) as refused:
            batch.run(StepPlan(1, (bad,)))
        assert refused.value.seq_ids == {0}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prompt_logprobs_match_transformers_computing_every_position_at_once(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = prompt(6, 40)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURES / "models" / name, torch_dtype=torch.float32
    )
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0, :-1]  # (n - 1, vocab)
    want = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
    got, _ = flat(score(loaded(name), ids, chunk=16))
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=TOL)
