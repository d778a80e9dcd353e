"""The offline driver: the server's batch loop without trio, for ``triollm generate`` and tests.

The server runs one loop in a trio task (``service.py``); this module runs the *same*
loop synchronously, against the same two objects:

- the :class:`~triollm.scheduler.Scheduler` (pure policy: who is admitted, what each
  step computes), and
- the :class:`~triollm.batch.Batch` (mechanism: the ragged forward pass over the paged
  KV cache, and per-sequence sampling).

One turn, as in ``plan.py``'s theory of operation::

    scheduler.admit_waiting()
    plan = scheduler.plan_step()
    result = batch.run(plan)
    finished = scheduler.commit(result)

Because nothing here is a simplified copy of the server's path, a test that runs
several prompts through :meth:`Engine.generate_many` and compares them with each prompt
run alone checks the real batching (``tests/test_offline.py``).

Trap: an empty plan while sequences are still live means no sequence can make
progress; offline there is nobody to free capacity, so :meth:`Engine._steps` raises
instead of spinning.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass

from triollm.batch import Batch
from triollm.model.constrained import MatcherFailed
from triollm.model.kvstore import DEFAULT_KV_DTYPE, KVDtype, kv_bytes_per_position
from triollm.model.loader import LoadedModel
from triollm.model.sampling import SamplingParams
from triollm.plan import Finished, FinishReason, SampledToken
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.sizing import OFFLINE_CHUNK_TOKENS, Capacity
from triollm.spec import GenerationSpec


def engine_config(
    loaded: LoadedModel,
    *,
    slots: int = 1,
    context_tokens: int | None = None,
    block_size: int | None = None,
    kv_dtype: KVDtype = DEFAULT_KV_DTYPE,
) -> SchedulerConfig:
    """A scheduler config whose pool holds ``slots`` sequences of the whole context.

    The sizing rules are ``sizing.py``'s, shared with the server: ``context_tokens``
    defaults to the model's ``max_position_embeddings``, and the pool holds every
    slot's whole context (up to ``sizing.DEFAULT_KV_MEMORY_BYTES`` by default), so
    the reserve policy can admit every slot at once: offline there is no queue of
    strangers to be fair to, only the caller's own prompts. The one offline choice is
    the longer prefill chunk (``sizing.OFFLINE_CHUNK_TOKENS``). ``kv_dtype`` must be
    the one the :class:`Engine` is given (the pool's blocks are sized by it). Raises
    :class:`~triollm.errors.FieldError` (``context_tokens``) for a context out of range.
    """
    capacity = Capacity(
        slots=slots,
        block_size=block_size,
        context_tokens=context_tokens,
        chunk_tokens=OFFLINE_CHUNK_TOKENS,
        kv_dtype=kv_dtype,
    )
    cfg = loaded.config
    per_position = kv_bytes_per_position(cfg, capacity.kv_dtype)
    return capacity.resolve(cfg.max_position_embeddings, per_position)


@dataclass(frozen=True, slots=True)
class Completion:
    """What one request produced: every sampled token (a stop token included) and why it ended."""

    prompt_ids: tuple[int, ...]
    tokens: tuple[SampledToken, ...]
    finish_reason: FinishReason

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


class Generation(Iterator[SampledToken]):
    """The token stream of one request; ``finish_reason`` is set once it is exhausted.

    Trap: breaking out of the loop early (a stop string matched) leaves the sequence
    holding KV blocks until :meth:`close` runs; ``for`` does not call it. Use the
    generation as a context manager, or call ``close()``: the sequence then ends with
    ``finish_reason`` STOP.
    """

    def __init__(self, engine: Engine, seq_id: int) -> None:
        self._engine = engine
        self.seq_id = seq_id
        self._events = engine._steps({seq_id})
        self.finish_reason: FinishReason | None = None

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> SampledToken:
        for event in self._events:
            if isinstance(event, SampledToken):
                return event
            self.finish_reason = event.reason
        raise StopIteration

    def close(self) -> None:
        if self.finish_reason is None:
            self._events.close()  # the generator's finally ends the sequence
            self.finish_reason = FinishReason.STOP

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine:
    """A Scheduler and a Batch over one loaded model, driven step by step in this thread.

    Not thread-safe and not re-entrant: one :class:`Generation` (or one
    :meth:`generate_many` call) at a time.
    """

    def __init__(
        self, loaded: LoadedModel, config: SchedulerConfig, kv_dtype: KVDtype = DEFAULT_KV_DTYPE
    ) -> None:
        self.loaded = loaded
        self.config = config
        # LongRoPE (Phi-3 128k) picks its factor list by the context served (model/phi3.py)
        loaded.model.use_context(config.context_tokens)
        self.scheduler = Scheduler(config)
        self.batch = Batch(
            loaded, num_blocks=config.num_blocks, block_size=config.block_size, kv_dtype=kv_dtype
        )

    def submit(self, spec: GenerationSpec) -> int:
        """Queue a request (``spec.n`` 1) in the scheduler and the batch; returns its
        seq_id. ``spec.max_tokens`` None: the rest of the context.

        Raises :class:`~triollm.scheduler.Infeasible` (nothing queued) when the
        prompt and ``max_tokens`` can never fit the context or the pool.
        """
        seq_id = self.scheduler.add(spec.sequence())
        self.batch.add(seq_id, spec)
        return seq_id

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop_token_ids: Iterable[int] = (),
    ) -> Generation:
        """Stream the tokens of one prompt as each step samples them."""
        return self.start(GenerationSpec(prompt_ids, params, max_tokens, stop_token_ids))

    def start(self, spec: GenerationSpec) -> Generation:
        """Stream the tokens of one request (``spec.n`` 1) as each step samples them."""
        return Generation(self, self.submit(spec))

    def generate_many(self, requests: Sequence[GenerationSpec]) -> list[Completion]:
        """Complete several prompts in one batch (as far as the slots allow), in order."""
        ids = [self.submit(r) for r in requests]
        tokens: dict[int, list[SampledToken]] = {i: [] for i in ids}
        reasons: dict[int, FinishReason] = {}
        for event in self._steps(set(ids)):
            if isinstance(event, SampledToken):
                tokens[event.seq_id].append(event)
            else:
                reasons[event.seq_id] = event.reason
        return [
            Completion(r.prompt_ids, tuple(tokens[i]), reasons[i])
            for r, i in zip(requests, ids, strict=True)
        ]

    def _steps(self, live: set[int]) -> Generator[SampledToken | Finished, None, None]:
        """Run steps until every sequence in ``live`` has finished, yielding as they come.

        A sampled token is yielded before the Finished of its sequence. Closing the
        generator early cancels whatever is still live, so its blocks go back.
        """
        live = set(live)
        try:
            while live:
                self.scheduler.admit_waiting()
                plan = self.scheduler.plan_step()
                if plan.is_empty:
                    stats = self.scheduler.statistics()
                    raise RuntimeError(
                        f"no sequence can make progress ({stats}); offline, nothing else "
                        "will free capacity"
                    )
                try:
                    result = self.batch.run(plan)
                except BaseException:
                    self.scheduler.discard_step()  # else the next plan_step refuses to plan
                    raise
                finished = self.scheduler.commit(result)
                if result.failed:
                    # Offline there is one caller: its grammar failing is its error.
                    bad = result.failed[0]
                    raise MatcherFailed(f"sequence {bad.seq_id}: {bad.message}")
                for token in result.sampled:
                    if token.seq_id in live:
                        yield token
                for done in finished:
                    self.batch.remove(done.seq_id)
                    live.discard(done.seq_id)
                    yield done
        finally:
            for seq_id in live:  # closed early, or an exception: give the blocks back
                self.scheduler.cancel(seq_id)
                self.batch.remove(seq_id)
