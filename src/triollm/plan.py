"""The messages that cross the line between policy and mechanism.

The Scheduler (pure policy, ``scheduler.py``) decides *what* one step computes and
says so in a :class:`StepPlan`. The Batch (mechanism, ``batch.py``) runs that plan
through the model and answers with a :class:`StepResult`. Neither reaches into the
other: everything the Batch needs to run a step is in the plan, and everything the
Scheduler learns from a step is in the result. That is what lets the simulator and
the property tests drive the real Scheduler with a fake executor, and what makes a
batching bug distinguishable from an admission bug (the seed's 20.3.2).

Theory of operation, one step:

1. ``plan = scheduler.plan_step()``: prefill chunks first (sequences with no first
   token yet, in admission order), then one row per decoding sequence, within the
   row budget. Each :class:`ChunkPlan` carries the token ids it feeds, the position
   of the first one, and the sequence's block table.
2. ``result = batch.run(plan)``: the ragged forward pass writes K/V for every row
   into the blocks named by the tables, and samples one token for every chunk
   whose ``sample`` is true.
3. ``scheduler.commit(result)``: sampled tokens are appended, sequences that hit
   EOS / a stop id / max_tokens finish and give their blocks back.

All of these are frozen: a plan handed to a worker thread cannot be changed under
it by the event loop, and a result cannot be edited after the fact.

This module imports nothing but the standard library (it is shared by the pure
scheduler, which must not import numpy or trio).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One sequence's rows in one step: a prefill chunk, or a single decode row.

    ``token_ids[i]`` sits at position ``start + i``. The forward pass writes the K/V
    of every row into the sequence's blocks (position ``p`` lives in block
    ``block_table[p // block_size]`` at offset ``p % block_size``) and attends
    causally over positions ``0 .. start + i``.

    Trap: ``block_table`` covers *at least* ``start + len(token_ids)`` positions; it
    may hold more (a reservation for the answer). The Batch must never read a
    position at or past ``start + len(token_ids)``.
    """

    seq_id: int
    token_ids: tuple[int, ...]  # the tokens computed this step, len >= 1
    start: int  # position of token_ids[0]; equals the sequence's tokens already computed
    block_table: tuple[int, ...]  # block ids in position order
    sample: bool  # True: the last row's logits are sampled (decode row, or a prompt's final chunk)
    prefill: bool  # True: these are prompt positions (a chunk); False: one decode row
    # Prompt scoring: row i predicts score_ids[i], the prompt token at position
    # start + i + 1, and the Batch returns that token's log-probability (PromptScores).
    # Empty: no row is scored. At most n_rows ids: a final chunk's last row predicts
    # the first answer token, which is sampled (or, with max_tokens 0, nothing).
    score_ids: tuple[int, ...] = ()

    @property
    def n_rows(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one forward pass computes. Prefill chunks come first, then decode rows.

    An empty plan (no chunks) means there is nothing to run this step: the caller
    sleeps until something arrives or frees capacity; it never runs an empty batch.
    """

    step: int  # the scheduler's step counter, echoed in the result
    chunks: tuple[ChunkPlan, ...]

    @property
    def n_rows(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token one sequence got this step, with optional log-probabilities."""

    seq_id: int
    token_id: int
    logprob: float | None = None  # log-probability of token_id, when the request asked
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    # The token completed the sequence's grammar (structured output): nothing can
    # follow it, so the sequence ends with STOP, whatever its stop ids say.
    completes: bool = False


@dataclass(frozen=True, slots=True)
class SequenceFailure:
    """A sequence the Batch could not sample this step (its grammar matcher failed).

    Its rows were computed but it got no token; the others in the step are unaffected.
    The caller ends it (an error event) and gives its blocks back.
    """

    seq_id: int
    message: str


@dataclass(frozen=True, slots=True)
class PromptScores:
    """The log-probabilities of the prompt tokens one scored chunk's rows predicted.

    ``logprobs[i]`` is log p(token at position ``first + i`` | the tokens before it)
    under the model's own distribution (the raw logits' log-softmax: no penalty or
    temperature, which belong to sampling the answer); ``top[i]`` the ``k`` most
    likely tokens there, ``(token_id, logprob)`` best first, ``k`` being the
    request's ``logprobs``. Positions, not a running list: a sequence preempted
    before its first token scores its prompt again, and the receiver overwrites.
    """

    seq_id: int
    first: int  # position of the first scored token: the chunk's start + 1
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]
    # ranks[i]: 1 + how many tokens were likelier than the prompt token there (vLLM's)
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the Batch produced for one StepPlan: one SampledToken per sampling chunk."""

    step: int
    sampled: tuple[SampledToken, ...]
    n_rows: int = 0  # rows the forward pass computed (for the step recorder / metrics)
    seconds: float = 0.0  # wall time of the forward + sampling (measured by the Batch)
    failed: tuple[SequenceFailure, ...] = ()  # sampled chunks that got no token, and why
    scores: tuple[PromptScores, ...] = ()  # one per chunk with score_ids, in chunk order


def chunk_problems(
    chunks: Sequence[ChunkPlan],
    *,
    vocab_size: int,
    block_size: int,
    num_blocks: int,
    max_positions: int | None = None,
) -> dict[int, str]:
    """What in ``chunks`` cannot run, by sequence id (empty: every chunk can).

    The one statement of a runnable chunk, for the two that run plans: the Batch
    (``Batch.check`` refuses the offending sequences alone, ``BadChunks``) and the
    model's forward pass (``LlamaModel.forward``, for a caller without a Batch). A
    token id past the vocabulary would index past the embedding table; a block table
    too short for the chunk's positions, or naming a block outside the pool, would
    write K/V into someone else's block (the kernels do no bounds checks).
    """
    bad: dict[int, str] = {}
    for chunk in chunks:
        ids = chunk.token_ids
        end = chunk.start + len(ids)
        if not ids:
            bad[chunk.seq_id] = "an empty chunk"
        elif min(ids) < 0 or max(ids) >= vocab_size:
            wrong = next(t for t in ids if not 0 <= t < vocab_size)
            bad[chunk.seq_id] = f"token id {wrong} is outside the vocabulary of {vocab_size}"
        elif chunk.start < 0 or len(chunk.block_table) * block_size < end:
            bad[chunk.seq_id] = (
                f"positions {chunk.start}..{end - 1} need {-(-end // block_size)} blocks of "
                f"{block_size}, block table has {len(chunk.block_table)}"
            )
        elif chunk.block_table and not all(0 <= b < num_blocks for b in chunk.block_table):
            bad[chunk.seq_id] = f"its block table names a block outside the pool of {num_blocks}"
        elif max_positions is not None and end > max_positions:
            bad[chunk.seq_id] = (
                f"position {end - 1} is past the model's max_position_embeddings ({max_positions})"
            )
        elif len(chunk.score_ids) > len(ids):
            bad[chunk.seq_id] = f"{len(chunk.score_ids)} scored tokens for {len(ids)} rows"
        elif chunk.score_ids and not all(0 <= t < vocab_size for t in chunk.score_ids):
            wrong = next(t for t in chunk.score_ids if not 0 <= t < vocab_size)
            bad[chunk.seq_id] = f"scored token id {wrong} is outside the vocabulary of {vocab_size}"
    return bad


class FinishReason(enum.Enum):
    """Why a sequence left the batch. The values are OpenAI's ``finish_reason``
    where one exists."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    TOOL_CALLS = "tool_calls"  # ended on its own after calling tools (textstream.py decides)
    CANCELLED = "cancelled"  # the client left, or was too slow; never sent as a finish_reason


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence that ended at a commit; its blocks are already back in the pool."""

    seq_id: int
    reason: FinishReason
    n_generated: int = field(default=0)
