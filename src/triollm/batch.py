"""The Batch: the mechanism that executes one StepPlan.

The Scheduler (policy) decides which rows run in a step and hands over a
:class:`~triollm.plan.StepPlan`; the Batch runs it: one ragged forward pass over
the paged KV cache, then one sampled token per chunk that asked for one. It owns
the two pieces of state the model needs across steps:

- the paged KV pool (:class:`~triollm.model.llama.PagedKVCache`), allocated once
  at the size of the scheduler's block pool; block *ownership* stays with the
  scheduler's ``BlockPool``, the Batch only stores what the tables point at;
- one :class:`~triollm.model.sampling.SequenceSampler` per live sequence (its
  seeded random generator and token counts), so a request's seed reproduces the
  same tokens whatever else shares the batch.

The Batch knows nothing of trio: :meth:`Batch.run` is a plain blocking call that
the service runs in a worker thread. The kernels release the GIL, so the event
loop keeps streaming while a step computes.

Read with ``plan.py`` (the messages), ``model/llama.py`` (the forward pass) and
``tests/model/test_batch.py`` (invariance and isolation).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from triollm.model.llama import LlamaModel, PagedKVCache
from triollm.model.loader import LoadedModel
from triollm.model.sampling import SamplingParams, SequenceSampler
from triollm.plan import SampledToken, StepPlan, StepResult


class BadChunks(ValueError):
    """Some chunks of a plan cannot run; nothing was computed (the KV pool is untouched).

    ``seq_ids`` names the offending sequences, so the caller can fail those alone
    and plan again for the others. Trap: catching a plain exception from
    :meth:`Batch.run` and failing the whole step lets one bad request kill every
    request that shared its forward pass.
    """

    def __init__(self, seq_ids: Sequence[int], message: str) -> None:
        super().__init__(message)
        self.seq_ids = frozenset(seq_ids)


class Batch:
    """Runs StepPlans: a ragged forward pass plus per-sequence sampling.

    ``num_blocks`` and ``block_size`` must equal the scheduler's pool, since
    the block ids in the plans index this cache. ``loaded`` may also be a bare
    :class:`LlamaModel` (the benchmark builds one without a directory).

    Trap: :meth:`add` a sequence before the first plan that samples it;
    :meth:`remove` it once the scheduler reports it finished or cancelled (a
    removal while a step runs is safe: that step still samples it, and the
    scheduler ignores the token).
    """

    def __init__(self, loaded: LoadedModel | LlamaModel, *, num_blocks: int, block_size: int):
        self.model = loaded if isinstance(loaded, LlamaModel) else loaded.model
        self.config = self.model.config
        self.kv = PagedKVCache(self.config, num_blocks, block_size)
        self.kv_bytes_per_position = self.config.kv_bytes_per_position()
        self.kv_bytes_total = self.kv.nbytes
        self._samplers: dict[int, SequenceSampler] = {}  # seq_id -> its sampling state

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def add(self, seq_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Start the sampling state of a new sequence (seeded, penalties see ``prompt_ids``)."""
        if seq_id in self._samplers:
            raise ValueError(f"sequence {seq_id} is already in the batch")
        self._samplers[seq_id] = SequenceSampler(params, prompt_ids)

    def remove(self, seq_id: int) -> None:
        """Forget a sequence's sampling state. Idempotent: cancel paths may race to it."""
        self._samplers.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._samplers

    def __len__(self) -> int:
        return len(self._samplers)

    def check(self, plan: StepPlan) -> None:
        """Raise :class:`BadChunks` naming every chunk that cannot run.

        A token id past the model's vocabulary would index past the embedding
        table (an IndexError halfway through the forward pass, or a silent read
        of another row in a compiled kernel); a block table too short for the
        chunk's positions would write K/V into someone else's block. Both are
        checked before anything is computed, so a refusal leaves the pool as it was.
        """
        vocab, size, nblocks = self.config.vocab_size, self.kv.block_size, self.kv.num_blocks
        bad: dict[int, str] = {}
        for chunk in plan.chunks:
            ids = chunk.token_ids
            if not ids:
                bad[chunk.seq_id] = "an empty chunk"
            elif min(ids) < 0 or max(ids) >= vocab:
                wrong = next(t for t in ids if not 0 <= t < vocab)
                bad[chunk.seq_id] = f"token id {wrong} is outside the model's vocabulary of {vocab}"
            elif len(chunk.block_table) * size < chunk.start + len(ids):
                bad[chunk.seq_id] = (
                    f"its block table ({len(chunk.block_table)} blocks x {size}) does not cover "
                    f"positions up to {chunk.start + len(ids)}"
                )
            elif chunk.block_table and not all(0 <= b < nblocks for b in chunk.block_table):
                bad[chunk.seq_id] = f"its block table names a block outside the pool of {nblocks}"
        if bad:
            detail = "; ".join(f"sequence {s}: {why}" for s, why in bad.items())
            raise BadChunks(tuple(bad), f"cannot run: {detail}")

    def run(self, plan: StepPlan) -> StepResult:
        """Compute ``plan``: forward every row, sample each chunk with ``sample=True``.

        Returns the tokens in chunk order, the row count and the wall time of
        forward + sampling. An empty plan computes nothing. Raises
        :class:`BadChunks` (nothing computed) if a chunk cannot run.
        """
        t0 = time.perf_counter()
        if plan.is_empty:
            return StepResult(step=plan.step, sampled=(), n_rows=0, seconds=0.0)
        self.check(plan)
        # Take the samplers now: a remove() from the event loop during the
        # forward pass must not turn into a KeyError halfway through sampling.
        samplers = []
        for chunk in plan.chunks:
            if chunk.sample:
                sampler = self._samplers.get(chunk.seq_id)
                if sampler is None:
                    raise ValueError(f"sequence {chunk.seq_id} is sampled but was never added")
                samplers.append((chunk.seq_id, sampler))
        logits = self.model.forward(plan.chunks, self.kv)  # (n_sampled, vocab) float32
        sampled = []
        for (seq_id, sampler), row in zip(samplers, logits, strict=True):
            s = sampler.sample(row)
            sampled.append(SampledToken(seq_id, s.token_id, s.logprob, s.top_logprobs))
        return StepResult(
            step=plan.step,
            sampled=tuple(sampled),
            n_rows=plan.n_rows,
            seconds=time.perf_counter() - t0,
        )
