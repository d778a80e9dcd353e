"""The Batch: the mechanism that executes one StepPlan.

The Scheduler (policy) decides which rows run in a step and hands over a
:class:`~triollm.plan.StepPlan`; the Batch runs it: one ragged forward pass over
the paged KV cache, then one sampled token per chunk that asked for one. It owns
the two pieces of state the model needs across steps:

- the paged KV pool (:class:`~triollm.model.kvstore.PagedKVCache`), allocated once
  at the size of the scheduler's block pool; block *ownership* stays with the
  KV-cache manager (``kvcache.KVCacheManager``, over ``kv.BlockPool``), the Batch
  only stores what the tables point at;
- one :class:`~triollm.model.sampling.SequenceSampler` per live sequence (its
  seeded random generator and token counts), so a request's seed reproduces the
  same tokens whatever else shares the batch;
- beside it, for a sequence whose params carry a grammar (structured output, a
  forced tool call), its :class:`~triollm.model.constrained.SequenceMatcher`.
  Each step the constrained rows' token masks are filled in a helper thread
  *while the forward pass runs* (both release the GIL), applied to their logits
  rows before sampling, and advanced with the sampled tokens. A grammar that is
  complete ends its sequence (``SampledToken.completes``); a matcher that fails
  costs its own sequence only (``StepResult.failed``). Unconstrained rows never
  touch any of it;
- for a sequence whose sampling parameters set ``min_tokens``, how many tokens it
  must still generate before its stop ids may be sampled: until then their logits
  are minus infinity (vLLM's ``min_tokens``).

A chunk with ``score_ids`` (a prompt whose log-probabilities were asked for: echo
with logprobs) gets every scored row's logits through the output head, in slices of
:data:`SCORE_SLICE_ROWS` rows so a long chunk never holds rows x vocab floats at
once, and answers with one :class:`~triollm.plan.PromptScores` (the same
log-probability rule as a sampled token's, ``sampling.token_logprobs``). The sampled
rows are computed as they would be without it: nobody else's tokens change.

The Batch knows nothing of trio: :meth:`Batch.run` is a plain blocking call that
the service runs in a worker thread. The kernels release the GIL, so the event
loop keeps streaming while a step computes.

Read with ``plan.py`` (the messages), ``model/llama.py`` (the forward pass) and
``tests/model/test_batch.py`` (invariance and isolation).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from triollm.model.constrained import MaskFiller, MatcherFailed, SequenceMatcher
from triollm.model.kvstore import DEFAULT_KV_DTYPE, KVDtype, PagedKVCache
from triollm.model.llama import LlamaModel
from triollm.model.loader import LoadedModel
from triollm.model.sampling import Sample, SequenceSampler, token_logprobs
from triollm.plan import (
    ChunkPlan,
    PromptScores,
    SampledToken,
    SequenceFailure,
    StepPlan,
    StepResult,
    chunk_problems,
)
from triollm.spec import GenerationSpec

# Scored prompt rows run through the output head this many at a time: 64 rows of a
# 49152-token vocabulary are 12.6 MB of float32 logits, where a whole 512-row chunk
# would be 100 MB. 64 rows already make the head's product compute bound (each
# weight read serves 64 rows), so larger slices would buy little.
SCORE_SLICE_ROWS = 64


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
    the block ids in the plans index this cache; ``kv_dtype`` is its element
    type (``model/kvstore.py``: 16-bit f16 by default, f32 for exact conformance).
    ``loaded`` may also be a bare :class:`LlamaModel` (the benchmark builds one
    without a directory).

    Trap: :meth:`add` a sequence before the first plan that samples it;
    :meth:`remove` it once the scheduler reports it finished or cancelled (a
    removal while a step runs is safe: that step still samples it, and the
    scheduler ignores the token).
    """

    def __init__(
        self,
        loaded: LoadedModel | LlamaModel,
        *,
        num_blocks: int,
        block_size: int,
        overlap_masks: bool = True,
        kv_dtype: KVDtype = DEFAULT_KV_DTYPE,
    ):
        self.model = loaded if isinstance(loaded, LlamaModel) else loaded.model
        self.config = self.model.config
        self.kv = PagedKVCache(self.config, num_blocks, block_size, kv_dtype)
        self.kv_bytes_per_position = self.kv.bytes_per_position
        self.kv_bytes_total = self.kv.nbytes
        self._samplers: dict[int, SequenceSampler] = {}  # seq_id -> its sampling state
        # Invariant: a key of _matchers is a key of _samplers (added and removed together).
        self._matchers: dict[int, SequenceMatcher] = {}  # seq_id -> its grammar's matcher
        # seq_id -> [tokens still to generate before a stop id may be sampled, the ids]
        self._held: dict[int, tuple[list[int], np.ndarray]] = {}
        # Built on the first constrained step: a server that never sees a grammar
        # never starts the thread or allocates the mask.
        self._masks: MaskFiller | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        # False: fill the masks after the forward pass instead of beside it (the
        # benchmark compares the two; see docs/constrained-decoding.md).
        self.overlap_masks = overlap_masks

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def add(
        self, seq_id: int, spec: GenerationSpec, choice: int = 0, generated: Sequence[int] = ()
    ) -> None:
        """Start the sampling state of sequence ``seq_id``, choice ``choice`` of ``spec``
        (seeded with ``spec.choice_sampling(choice)``; penalties see the prompt).

        ``generated``: tokens the sequence already has (it is re-added after its state
        was lost); its grammar matcher is replayed over them and its sampler counts
        them, so both stand where the sequence does. With ``sampling.min_tokens``, the
        ids the answer ends on (``spec.stop_token_ids``) are held back that long.
        """
        if seq_id in self._samplers:
            raise ValueError(f"sequence {seq_id} is already in the batch")
        sampling = spec.choice_sampling(choice)
        left = sampling.min_tokens - len(generated)
        if left > 0 and spec.stop_token_ids:
            ids = np.fromiter(sorted(spec.stop_token_ids), dtype=np.int64)
            self._held[seq_id] = ([left], ids)
        sampler = SequenceSampler(sampling, spec.prompt_ids)
        for t in generated:
            sampler.accept(t)
        if sampling.grammar is not None:
            matcher = sampling.grammar.start()
            matcher.replay(generated)  # raises MatcherFailed: the tokens break the grammar
            self._matchers[seq_id] = matcher
        self._samplers[seq_id] = sampler

    def remove(self, seq_id: int) -> None:
        """Forget a sequence's sampling state. Idempotent: cancel paths may race to it."""
        self._samplers.pop(seq_id, None)
        self._matchers.pop(seq_id, None)
        self._held.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._samplers

    def __len__(self) -> int:
        return len(self._samplers)

    def check(self, plan: StepPlan) -> None:
        """Raise :class:`BadChunks` naming every chunk that cannot run
        (``plan.chunk_problems``, the one statement of a runnable chunk).

        Checked before anything is computed, so a refusal leaves the pool as it was;
        the offending sequences are named, so the caller fails those alone.
        """
        bad = chunk_problems(
            plan.chunks,
            vocab_size=self.config.vocab_size,
            block_size=self.kv.block_size,
            num_blocks=self.kv.num_blocks,
            max_positions=self.config.max_position_embeddings,
        )
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
        # Take the samplers and matchers now: a remove() from the event loop during
        # the forward pass must not turn into a KeyError halfway through sampling.
        rows: list[tuple[int, SequenceSampler, SequenceMatcher | None]] = []
        held: dict[int, tuple[list[int], np.ndarray]] = {}
        for chunk in plan.chunks:
            if chunk.sample:
                sampler = self._samplers.get(chunk.seq_id)
                if sampler is None:
                    raise ValueError(f"sequence {chunk.seq_id} is sampled but was never added")
                rows.append((chunk.seq_id, sampler, self._matchers.get(chunk.seq_id)))
                if chunk.seq_id in self._held:
                    held[chunk.seq_id] = self._held[chunk.seq_id]
        scoring: list[tuple[ChunkPlan, int]] = []  # (scored chunk, its top-n)
        for chunk in plan.chunks:
            if chunk.score_ids:
                sampler = self._samplers.get(chunk.seq_id)
                if sampler is None:
                    raise ValueError(f"sequence {chunk.seq_id} is scored but was never added")
                scoring.append((chunk, sampler.params.scored_top_n))
        matchers = [m for _, _, m in rows if m is not None]
        filling = self._start_masks(matchers)
        hidden = None
        try:
            if scoring:
                logits, hidden = self.model.forward_scored(plan.chunks, self.kv)
            else:
                logits = self.model.forward(plan.chunks, self.kv)  # (n_sampled, vocab) float32
        finally:
            # Hazard: the fill writes the mask buffer with the GIL released; it must
            # end before anything reads the buffer or a later step refills it.
            if filling is not None:
                filling.result()
        if filling is None and matchers:
            self._fill(matchers)
        samples: list[tuple[int, Sample, SequenceMatcher | None]] = []
        failed: list[SequenceFailure] = []
        mask_row = 0
        for (seq_id, sampler, matcher), row in zip(rows, logits, strict=True):
            if matcher is not None:
                assert self._masks is not None  # the fill above built it
                try:
                    matcher.check()  # a fill can leave a matcher in its error state
                    self._masks.apply(mask_row, row)
                except MatcherFailed as exc:
                    failed.append(SequenceFailure(seq_id, str(exc)))
                    continue
                finally:
                    mask_row += 1
            if seq_id in held and held[seq_id][0][0] > 0:
                _hold_back(row, held[seq_id][1])
            samples.append((seq_id, sampler.sample(row), matcher))
        # Matchers advance only once every row is sampled: a step that raises before
        # this point is discarded by the caller, and must leave no matcher ahead.
        sampled: list[SampledToken] = []
        for seq_id, s, matcher in samples:
            completes = False
            if matcher is not None:
                try:
                    completes = matcher.advance(s.token_id)
                except MatcherFailed as exc:
                    failed.append(SequenceFailure(seq_id, str(exc)))
                    continue
            sampled.append(SampledToken(seq_id, s.token_id, s.logprob, s.top_logprobs, completes))
            if seq_id in held:
                held[seq_id][0][0] -= 1  # counted only once the step's tokens stand
        scores = self._score(scoring, hidden) if hidden is not None else ()
        return StepResult(
            step=plan.step,
            sampled=tuple(sampled),
            n_rows=plan.n_rows,
            seconds=time.perf_counter() - t0,
            failed=tuple(failed),
            scores=scores,
        )

    def _score(
        self, scoring: list[tuple[ChunkPlan, int]], hidden: np.ndarray
    ) -> tuple[PromptScores, ...]:
        """The scored chunks' PromptScores, from their rows' normed hidden states
        (``(n_scored, hidden)`` float32, chunk after chunk), a slice at a time."""
        ids = np.fromiter(
            (t for chunk, _ in scoring for t in chunk.score_ids), dtype=np.int64, count=len(hidden)
        )
        top_of_row = [n for chunk, n in scoring for _ in chunk.score_ids]
        chosen = np.empty(len(hidden), dtype=np.float64)
        ranks = np.empty(len(hidden), dtype=np.int64)
        best: list[tuple[tuple[int, float], ...]] = []
        for lo in range(0, len(hidden), SCORE_SLICE_ROWS):
            hi = min(lo + SCORE_SLICE_ROWS, len(hidden))
            logits = self.model.head(hidden[lo:hi])  # (<= SCORE_SLICE_ROWS, vocab) float32
            tops = top_of_row[lo:hi]
            chosen[lo:hi], alts = token_logprobs(logits, ids[lo:hi], max(tops))
            best.extend(a[:n] for a, n in zip(alts, tops, strict=True))
            # vLLM's rank: 1 + how many tokens the model found likelier (one compare
            # per vocabulary entry; the head's product spent a hidden-size dot on each)
            own = logits[np.arange(hi - lo), ids[lo:hi]]  # (rows,) float32
            ranks[lo:hi] = 1 + (logits > own[:, None]).sum(axis=1)
        out: list[PromptScores] = []
        row = 0
        for chunk, _ in scoring:
            m = len(chunk.score_ids)
            lps = tuple(float(v) for v in chosen[row : row + m])
            rank = tuple(int(r) for r in ranks[row : row + m])
            top = tuple(best[row : row + m])
            out.append(PromptScores(chunk.seq_id, chunk.start + 1, lps, top, rank))
            row += m
        return tuple(out)

    def _fill(self, matchers: list[SequenceMatcher]) -> None:
        if self._masks is None:
            self._masks = MaskFiller(matchers[0].mask_vocab)
        self._masks.fill(matchers)

    def _start_masks(self, matchers: list[SequenceMatcher]) -> Future[None] | None:
        """Start filling the constrained rows' masks beside the forward pass (or not)."""
        if not matchers or not self.overlap_masks:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="triollm-masks")
        return self._mask_thread.submit(self._fill, matchers)


def _hold_back(row: np.ndarray, ids: np.ndarray) -> None:
    """``min_tokens``: the stop ids cannot be sampled from ``row`` (in place). If they
    are all that is left (a grammar allows nothing else), the row is left as it was:
    the answer's rule wins over its length."""
    ids = ids[ids < row.shape[0]]
    kept = row[ids].copy()
    row[ids] = -np.inf
    if not np.isfinite(row).any():
        row[ids] = kept
