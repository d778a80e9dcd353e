"""The Scheduler: who is admitted, and what each forward pass computes.

A pure state machine over integers, in the style of h11's ``Connection``: no trio,
no numpy, no clock, no I/O. Requests (:class:`~triollm.spec.SequenceSpec`) and
sampled token ids go in; :class:`~triollm.plan.StepPlan` messages come out. The
live server, the offline engine, the simulator (``triollm simulate``) and the
property tests all drive this same object. One turn of the batch loop::

    scheduler.admit_waiting()        # the admission queue's driver, or the offline loop
    plan = scheduler.plan_step()     # empty plan: sleep until something changes
    result = batch.run(plan)         # in a worker thread: the plan is frozen
    finished = scheduler.commit(result)

Exactly one plan is in flight between ``plan_step`` and ``commit`` (``discard_step``
drops one whose run failed). A sequence with ``n`` token ids (prompt + generated)
has the K/V of ``n_computed`` positions; while it decodes ``n_computed == n - 1``,
since its last sampled token is fed by the next decode row.

Three collaborators keep this file to admission and step composition:

- ``kvcache.KVCacheManager`` (``self.kv``) holds every block table, the positions
  written, the prefix cache, a group's shared blocks and the KV events; the
  Scheduler asks it with seq_ids and never touches a block id itself;
- ``policies.SchedulingPolicy`` (``config.policy``) answers every open decision
  from frozen views, and every answer is checked (:class:`PolicyError`);
- ``kv.BlockPool`` underneath the manager, the allocator.

The rules, each taught in docs/scheduling.md (or docs/prefix-cache.md) with its
test; where each lives:

1. Refuse at the door what can never run: ``_infeasible``, ``check_group``.
2. Admission takes its blocks all together or not at all: ``_can_admit``,
   ``_admit`` (how many: the policy's ``admission_blocks``).
3. FCFS with at most K overtakes of the head: ``admit_waiting``.
4. Step composition (left-out decoders, then prefill chunks, then decode rows,
   within ``step_rows``; while anyone decodes the chunks share one
   ``stall_rows``; nobody is evicted for a row): ``plan_step``.
5. Growth and preemption (recompute, at the original ticket): ``_grow``,
   ``_preempt``, ``_readmit_preempted``.
6. Cancellation frees every block at once; ``commit`` ignores results for
   sequences that ended mid-step: ``cancel``, ``_release`` (the hazard of K/V
   reuse across threads is written there).
7. Deadlock is detected, never spun on: ``_empty_plan``, ``deadlock_report``.
8. The policy decides, the Scheduler acts: ``_admission_blocks``,
   ``_ordered_waiting``, ``_decode_order``, ``_victim``.
9. Prefix cache: ``_cache_hits`` asks the manager; hashing, publishing and the LRU
   are ``KVCacheManager.computed_blocks`` / ``commit`` (kvcache.py, its rules 1-3).
10. The n choices of one prompt are a group, admitted whole: ``add_group``,
    ``_group_need``, ``_admit_group``; the writer, its heir and the wait are the
    manager's (``KVCacheManager.admit_member`` / ``ready`` / ``free``).
11. A scored prompt computes and scores every position: ``_chunk``, ``_cache_hits``,
    ``commit``.
"""

from __future__ import annotations

import bisect
import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from triollm.errors import FieldError
from triollm.kv import BlockPool, blocks_for
from triollm.kvcache import KVCacheManager
from triollm.plan import ChunkPlan, Finished, FinishReason, StepPlan, StepResult
from triollm.policies import (
    Claim,
    Policy,
    PolicyError,
    SchedulerView,
    SchedulingPolicy,
    SeqView,
    builtin,
    missing_members,
    policy_name,
)
from triollm.spec import SequenceSpec

__all__ = [
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "RUNNING_STATES",
    "TERMINAL_STATES",
    "DeadlockError",
    "DeadlockReport",
    "Holder",
    "Infeasible",
    "Policy",
    "PolicyError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStatistics",
    "SeqState",
    "SequenceInfo",
    "serving_chunk_tokens",
    "serving_stall_rows",
]


class SeqState(enum.Enum):
    """Where a sequence is. WAITING -> PREFILLING -> DECODING -> FINISHED | CANCELLED;
    a preempted sequence goes back to WAITING and keeps its ticket."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"


# A request's priority (smaller first) is a signed 32-bit integer: room for any ranking
# and for a deadline in epoch seconds (earliest deadline first), and exact in every JSON
# client (JavaScript's numbers stop being exact integers past 2**53).
PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1

RUNNING_STATES = frozenset({SeqState.PREFILLING, SeqState.DECODING})
TERMINAL_STATES = frozenset({SeqState.FINISHED, SeqState.CANCELLED})

# How many finished/cancelled sequences keep answering state(); older ones are
# forgotten so a long-running server's memory does not grow with every request.
_TERMINAL_MEMORY = 65536


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the Scheduler needs, validated once. Units are in the names.

    The defaults are the server's (``triollm serve`` reads its flag defaults from
    here); the offline driver asks for a longer chunk explicitly (``sizing.py``).

    Trap: ``step_rows`` must be at least ``slots``: rule 4 promises a left-out
    decoding sequence a row in the next step, and there can be ``slots`` of them.
    """

    num_blocks: int  # KV blocks in the pool (the Batch allocates the arrays to match)
    block_size: int = 32  # positions per block; Forma's value, a multiple of a SIMD width
    slots: int = 4  # sequences running at once; bounds memory and the batch's width
    # Prefill tokens per sequence per step (rule 4, docs/scheduling.md §5).
    # A step carrying a chunk stalls every decoding stream for as long as the chunk
    # takes, and the stall grows with the chunk, while a long prompt's time to first
    # token barely depends on it down to ~64-128 tokens (prefill is compute bound).
    # bench/bench_step_rows.py measured
    # 128 at about a quarter of 512's decode stall for the same TTFT
    # (docs/serving.md, "Choosing the step budget"). That was SmolLM2-135M; the
    # server scales it to the model it serves (serving_chunk_tokens).
    chunk_tokens: int = 128
    # Rows per forward pass; None (the default) means chunk_tokens + slots: a full
    # chunk plus every decoder, so a chunk never pushes a decoder out of its step
    # (step_rows = chunk_tokens measured 1.5x longer stalls). __post_init__ resolves
    # None, so every reader sees an int: hence the type, and the one ignore.
    step_rows: int = None  # type: ignore[assignment]
    # Prefill rows of a whole step (all prompts together) while any sequence decodes:
    # the stall budget (rule 4, docs/scheduling.md §5). Every decoding stream waits for
    # each of those rows, so this bounds the longest gap between two of its tokens; a
    # step with nobody decoding stalls nobody and keeps the full chunk. None (the
    # default) means chunk_tokens; the server sizes it to the model it serves
    # (serving_stall_rows). At most chunk_tokens: a larger one would be the chunk.
    stall_rows: int = None  # type: ignore[assignment]
    context_tokens: int = 2048  # positions one sequence may reach (prompt + answer)
    # A built-in's name, or any object with the SchedulingPolicy interface (policies.py).
    policy: Policy | SchedulingPolicy = Policy.RESERVE  # never deadlocks, never recomputes
    overtake_limit: int | None = None  # K; None means K = slots; 0 = strict FIFO
    preempt_watermark_blocks: int = (
        1  # preempt: free blocks an admission must leave, against thrash
    )
    # Share full KV blocks between prompts with the same opening (rule 9). Off here so
    # the pure core's default is the plain paged pool; the server turns it on.
    prefix_cache: bool = False
    # Record the KV events (block stored / removed / cleared) for a publisher to drain
    # from ``scheduler.kv.drain_events()`` after each step. Off: unread, they would
    # only grow.
    kv_events: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):  # let callers and JSON files say "free-slot"
            try:
                object.__setattr__(self, "policy", Policy(self.policy))
            except ValueError:
                names = ", ".join(p.value for p in Policy)
                raise ValueError(f"policy must be one of {names}, got {self.policy!r}") from None
        elif not isinstance(self.policy, Policy):
            missing = missing_members(self.policy)
            if missing:
                raise ValueError(
                    f"policy {self.policy!r} is not a scheduling policy: it lacks "
                    f"{', '.join(missing)}"
                )
        if self.step_rows is None and isinstance(self.chunk_tokens, int):
            object.__setattr__(self, "step_rows", self.chunk_tokens + self.slots)
        if self.stall_rows is None and isinstance(self.chunk_tokens, int):
            object.__setattr__(self, "stall_rows", self.chunk_tokens)
        for name in (
            "num_blocks",
            "block_size",
            "slots",
            "chunk_tokens",
            "step_rows",
            "stall_rows",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.context_tokens, int) or self.context_tokens < 2:
            raise ValueError(
                f"context_tokens must be an integer >= 2 (a prompt token and an answer), "
                f"got {self.context_tokens!r}"
            )
        if self.step_rows < self.slots:
            raise ValueError(
                f"step_rows ({self.step_rows}) must be >= slots ({self.slots}): every "
                "left-out decoding sequence is promised a row in the next step"
            )
        if self.stall_rows > self.chunk_tokens:
            raise ValueError(
                f"stall_rows ({self.stall_rows}) must be <= chunk_tokens "
                f"({self.chunk_tokens}): it bounds the prefill rows beside decoders, and a "
                "chunk is the most one prompt takes in a step"
            )
        if self.overtake_limit is not None and self.overtake_limit < 0:
            raise ValueError(f"overtake_limit must be >= 0 or None, got {self.overtake_limit}")
        if self.preempt_watermark_blocks < 0:
            raise ValueError(
                f"preempt_watermark_blocks must be >= 0, got {self.preempt_watermark_blocks}"
            )

    @property
    def implementation(self) -> SchedulingPolicy:
        """The policy object the Scheduler asks (a built-in's, or the one given)."""
        return builtin(self.policy) if isinstance(self.policy, Policy) else self.policy

    @property
    def overtake_k(self) -> int:
        """K: how many times the head of the queue may be passed."""
        return self.slots if self.overtake_limit is None else self.overtake_limit

    @property
    def largest_request(self) -> int:
        """Positions (prompt + max_tokens) of the largest request an empty pool admits:
        the context, or less when the pool holds fewer positions than one context."""
        return min(self.context_tokens, self.num_blocks * self.block_size)


class DeadlockError(RuntimeError):
    """A policy that claims ``no-deadlock`` deadlocked: nothing running can move and no
    waiter can be admitted. ``report`` says who holds what."""

    def __init__(self, report: DeadlockReport, policy: str) -> None:
        super().__init__(f"policy {policy} claims no deadlock, yet: {report.describe()}")
        self.report = report


class Infeasible(FieldError):
    """A request that could never run on this pool and context; refused before it queues.

    ``field`` names the request field to blame (``"prompt"`` or ``"max_tokens"``);
    the HTTP layer reports it as ``param``. ``str()`` gives the numbers.
    """


# The serving chunk follows the model. Prefill is compute bound (two FLOPs per weight
# per row), so a chunk's stall grows with its rows times the weights each row
# multiplies in the layers. SchedulerConfig's 128 rows were measured on SmolLM2-135M,
# whose layers hold 106,168,320 weights: a larger model keeps that product with fewer
# rows. Qwen2.5-1.5B's layers hold 1.3 G; with 128-row chunks its 8 streams saw an ITL
# p99 of 1.9 s against llama-server's 0.78 s (docs/performance.md). Qwen2.5-0.5B at 8
# streams, 32 rows against 128: aggregate 1.09-1.29x, TTFT p50 0.87-0.95x, e2e p50
# 0.76-0.91x on 32-token completions; ITL p99 0.26-0.53x on chat prompts, whose
# template makes them several chunks (3 alternating rounds each, busy machine, load
# 12-20; issue 23's report).
CHUNK_STALL_ROW_WEIGHTS = 128 * 106_168_320
# The floor: a short prompt (a chat turn; the benchmark's 32 tokens) stays one chunk,
# so its first token takes one step; and below ~32 rows each chunk would read every
# weight again for a stall hardly shorter than the decoders' own step.
MIN_SERVING_CHUNK_TOKENS = 32


def serving_chunk_tokens(row_weights: int) -> int:
    """The server's prefill chunk for a model whose layers multiply ``row_weights``
    weights per row (embedding and output head not counted: the first is a lookup,
    the second runs on sampled rows only).

    A power of two between :data:`MIN_SERVING_CHUNK_TOKENS` and the measured 128, so
    that chunk x weights stays near :data:`CHUNK_STALL_ROW_WEIGHTS`. Trap: only the
    default; ``--chunk`` (``Capacity.chunk_tokens``) wins over it."""
    if row_weights < 1:
        raise ValueError(f"row_weights must be >= 1, got {row_weights}")
    most = SchedulerConfig.chunk_tokens  # the class attribute: the measured default
    rows = max(CHUNK_STALL_ROW_WEIGHTS // row_weights, 1)
    return max(MIN_SERVING_CHUNK_TOKENS, min(most, 1 << (rows.bit_length() - 1)))


# The serving stall budget follows the model too, but through a ratio, not a size. A
# decode step streams every weight byte once (bandwidth bound); a prefill row
# multiplies every layer weight (compute bound). So the rows whose compute costs about
# one decode step grow with the bytes the model holds per weight a row multiplies
# (``weight_bytes / row_weights``), whatever its size: 4-5 bit files ~0.9, bf16 ~2.5.
# Measured on the served conc-8 timeline (bench/bench_serverpath.py --timeline, busy
# machine): Qwen2.5-1.5B Q4_K_M, an 8-stream decode step ~140 ms and ~8.8 ms per prefill
# row beside it (16 rows per step's worth; 0.85 bytes per row weight); SmolLM2-135M
# Q4_1, ~37 ms and ~1.75 ms (21 rows; 0.93). 20 rows per byte per weight sits between
# them: a step beside decoders then carries about one decode step of prefill, so a
# decoding stream's longest gap is about two decode steps, not the 3-7 a full chunk of
# 32 (1.5B) or 128 (SmolLM2) rows made it.
STALL_ROWS_PER_WEIGHT_BYTE = 20
# The floor: fewer rows would spread even a chat turn's prompt over many steps, each
# reading every weight again, for a stall hardly shorter than the decode step itself.
MIN_SERVING_STALL_ROWS = 8


def serving_stall_rows(row_weights: int, weight_bytes: int, chunk_tokens: int) -> int:
    """The server's ``stall_rows`` (prefill rows beside decoders) for a model whose
    layers multiply ``row_weights`` weights per row and which holds ``weight_bytes``
    bytes of weights (what a decode step streams), serving chunks of ``chunk_tokens``.

    A power of two between :data:`MIN_SERVING_STALL_ROWS` and the chunk, near
    :data:`STALL_ROWS_PER_WEIGHT_BYTE` x bytes per row weight. Trap: only the default;
    ``--stall-rows`` wins over it, and a chunk below the floor is the bound itself."""
    if row_weights < 1 or weight_bytes < 1 or chunk_tokens < 1:
        raise ValueError(
            f"row_weights, weight_bytes and chunk_tokens must be >= 1, got "
            f"{row_weights}, {weight_bytes}, {chunk_tokens}"
        )
    rows = max(STALL_ROWS_PER_WEIGHT_BYTE * weight_bytes // row_weights, 1)
    return min(chunk_tokens, max(MIN_SERVING_STALL_ROWS, 1 << (rows.bit_length() - 1)))


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """A snapshot of one live sequence (for the simulator, metrics and tests)."""

    seq_id: int
    ticket: int  # arrival order; kept across preemption
    priority: int  # smaller goes first, under a policy that orders by it
    state: SeqState
    slot: int | None  # which slot it occupies; None while waiting
    prompt_len: int
    n_generated: int
    n_computed: int  # positions whose K/V is written
    max_tokens: int  # the resolved answer budget
    blocks: tuple[int, ...]  # its block table
    first_token_step: int | None  # the step whose commit gave its first token; None before
    preemptions: int
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    # Rule 10: the group member whose prefill it waits for (it is not planned until that
    # one has committed the shared blocks); None: it runs like any other.
    waits_for: int | None = None


@dataclass(frozen=True, slots=True)
class Holder:
    """One running sequence in a deadlock: what it holds and what it waits for."""

    seq_id: int
    blocks: tuple[int, ...]
    n_computed: int
    blocks_needed: int  # more blocks it needs before its next row


@dataclass(frozen=True, slots=True)
class DeadlockReport:
    """Why nothing can run: every running sequence waits for a block none can free."""

    step: int  # the scheduler's step counter when it was detected
    holders: tuple[Holder, ...]
    waiting: tuple[int, ...]  # seq_ids queued behind them
    free_blocks: int

    def describe(self) -> str:
        held = "; ".join(
            f"seq {h.seq_id} holds {len(h.blocks)} block(s) {list(h.blocks)} after "
            f"{h.n_computed} positions and needs {h.blocks_needed} more"
            for h in self.holders
        )
        return (
            f"deadlock after step {self.step}: {self.free_blocks} block(s) free; {held}; "
            f"waiting: {list(self.waiting) or 'none'}"
        )


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """A frozen snapshot of the Scheduler's counters and gauges."""

    policy: Policy | SchedulingPolicy  # as configured
    step: int  # non-empty plans issued so far
    waiting: int
    running: int
    prefilling: int
    decoding: int
    free_slots: int
    blocks_total: int
    blocks_free: int  # blocks admission may take: free ones plus cached ones (rule 9)
    blocks_held: int  # blocks_free + blocks_held == blocks_total
    blocks_cached: int  # of blocks_free, those whose content a later prompt can still hit
    deadlocked: bool
    admitted_total: int  # admissions, counting each readmission after a preemption
    finished_total: int
    cancelled_total: int
    preemptions_total: int
    prefix_cache_queries_total: int = 0  # prompt tokens looked up at admission (vLLM's name)
    prefix_cache_hits_total: int = 0  # of those, tokens whose K/V was found in the cache


class _Seq:
    """The Scheduler's private record of one sequence. Only the Scheduler mutates it.
    Its blocks, positions written and prefix hashes are the KV-cache manager's,
    under the same seq_id."""

    __slots__ = (
        "admission",
        "first_token_step",
        "group",
        "left_out",
        "max_tokens",
        "overtaken",
        "passed",
        "preemptions",
        "priority",
        "prompt_len",
        "score",
        "seq_id",
        "state",
        "stop_ids",
        "ticket",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        ticket: int,
        prompt: Sequence[int],
        max_tokens: int,
        stop: frozenset[int],
        priority: int,
    ) -> None:
        self.seq_id = seq_id
        self.ticket = ticket
        self.priority = priority
        self.prompt_len = len(prompt)
        # Invariant: token_ids = prompt + every token sampled so far (the Batch gets
        # its chunk's ids from here; a preempted sequence recomputes all of them).
        self.token_ids: list[int] = list(prompt)
        self.max_tokens = max_tokens
        self.stop_ids = stop
        self.state = SeqState.WAITING
        self.admission = 0  # admission counter value; orders rows within a step
        self.first_token_step: int | None = None
        self.left_out = False  # a decoding sequence with no row in the last step
        self.passed = 0  # times overtaken while it was the head of the queue
        self.overtaken = 0  # later arrivals admitted while it waited (a policy may age by it)
        self.preemptions = 0
        self.score = False  # rule 11: its prompt's log-probabilities are wanted
        # Rule 10. While it waits for its first admission: its group (else None).
        self.group: _Group | None = None

    @property
    def n_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def scoring(self) -> bool:
        """Rule 11: every prompt position must still be computed, and scored."""
        return self.score and self.first_token_step is None


class _Group:
    """The waiting members of one ``add_group`` (rule 10), in ticket order."""

    __slots__ = ("members",)

    def __init__(self, members: list[_Seq]) -> None:
        self.members = members


class Scheduler:
    """The policy half of the server (see the module docstring for the rules).

    Not thread-safe: one task owns it. The Batch runs a frozen plan in a worker
    thread while the event loop may call ``cancel``; that is safe because
    ``commit`` re-checks every sequence it is told about.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.policy = config.implementation  # asked every decision; owns no state of ours
        # Block tables, positions written, the prefix cache (rules 9-10): kvcache.py.
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            prefix_cache=config.prefix_cache,
            record_events=config.kv_events,
        )
        self._seqs: dict[int, _Seq] = {}  # live sequences (waiting or running)
        self._terminal: OrderedDict[int, SeqState] = OrderedDict()
        self._waiting: list[tuple[int, int]] = []  # (ticket, seq_id), sorted by ticket
        self._running: list[int] = []  # seq_ids in admission order
        self._slot_of: dict[int, int] = {}
        self._next_id = 0
        self._next_admission = 0
        self._step = 0
        self._inflight: StepPlan | None = None
        self._batch_open = True  # static: may the current batch still take members?
        self._last_plan_preempted = False
        self._deadlock: DeadlockReport | None = None
        self._admitted_total = 0
        self._finished_total = 0
        self._cancelled_total = 0
        self._preemptions_total = 0
        # Within one admit_waiting pass: a group member admitted -> its whole group.
        self._companions: dict[int, tuple[int, ...]] = {}

    @property
    def pool(self) -> BlockPool:
        """The block pool under the KV-cache manager (to look at; only ``kv`` changes it)."""
        return self.kv.pool

    # -- the door ---------------------------------------------------------------

    def feasible(self, prompt_len: int, max_tokens: int | None) -> str | None:
        """``None`` if a request of this shape could run on an empty pool; else why not."""
        problem = self._infeasible(prompt_len, max_tokens)
        return None if problem is None else str(problem)

    def _infeasible(
        self, prompt_len: int, max_tokens: int | None, score_prompt: bool = False
    ) -> Infeasible | None:
        cfg = self.config
        ctx = cfg.context_tokens
        if prompt_len < 1:
            return Infeasible("prompt", "the prompt is empty; at least one token is needed")
        if max_tokens is not None and max_tokens < (0 if score_prompt else 1):
            return Infeasible(
                "max_tokens",
                f"max_tokens must be >= 1 (0 only for a request that scores its prompt), "
                f"got {max_tokens}",
            )
        if prompt_len >= ctx:
            return Infeasible(
                "prompt",
                f"prompt ({prompt_len} tokens) leaves no room for an answer in the "
                f"context of {ctx} positions",
            )
        answer = ctx - prompt_len if max_tokens is None else max_tokens
        if prompt_len + answer > ctx:
            return Infeasible(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({answer}) = {prompt_len + answer} "
                f"exceeds the context of {ctx} positions",
            )
        need = blocks_for(prompt_len + answer, cfg.block_size)
        if need > cfg.num_blocks:
            # Blame what the client can change: the answer budget, unless the prompt
            # and a one-token answer are already too big for the pool.
            prompt_fits = blocks_for(prompt_len + 1, cfg.block_size) <= cfg.num_blocks
            unset = " (unset: the rest of the context)" if max_tokens is None else ""
            return Infeasible(
                "max_tokens" if prompt_fits else "prompt",
                f"prompt ({prompt_len} tokens) + max_tokens ({answer}{unset}) = "
                f"{prompt_len + answer} positions need {need} blocks of {cfg.block_size}, "
                f"but the whole pool has {cfg.num_blocks}",
            )
        return None

    def add(self, spec: SequenceSpec) -> int:
        """Queue one request (``spec.n`` must be 1) as a WAITING sequence with the next
        arrival ticket; returns its id.

        ``spec.max_tokens=None`` means the rest of the context. ``spec.priority`` (an
        integer in ``PRIORITY_MIN..PRIORITY_MAX``, else ``FieldError``) is only read by
        a policy that orders by it (smaller first); any other policy ignores it, and
        refusing it is the server's business (``Service.submit``), not the simulator's.
        ``spec.cache_salt`` is the prefix cache's domain: only sequences with equal
        salts share blocks (rule 9). ``spec.score_prompt``: the Batch returns the
        log-probability of every prompt token after the first, and ``max_tokens`` may
        be 0 (rule 11). Raises :class:`Infeasible` (nothing queued) when it could never
        run. Trap: ``add`` never admits; call ``admit_waiting``.
        """
        if spec.n != 1:
            raise ValueError(f"add queues one sequence; add_group queues n={spec.n}")
        return self._add(spec)

    def _add(self, spec: SequenceSpec) -> int:
        prompt_ids, max_tokens, priority = spec.prompt_ids, spec.max_tokens, spec.priority
        problem = self._infeasible(len(prompt_ids), max_tokens, spec.score_prompt)
        if problem is not None:
            raise problem
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not PRIORITY_MIN <= priority <= PRIORITY_MAX
        ):
            raise FieldError(
                "priority",
                f"'priority' must be an integer between {PRIORITY_MIN} and {PRIORITY_MAX} "
                f"(smaller is served earlier), got {priority!r}",
            )
        answer = self.config.context_tokens - len(prompt_ids) if max_tokens is None else max_tokens
        seq_id = self._next_id
        self._next_id += 1
        seq = _Seq(seq_id, seq_id, prompt_ids, answer, spec.stop_token_ids, priority)
        seq.score = spec.score_prompt
        self._seqs[seq_id] = seq
        self.kv.add(seq_id, len(prompt_ids), spec.cache_salt)
        bisect.insort(self._waiting, (seq.ticket, seq_id))
        return seq_id

    def add_group(self, spec: SequenceSpec) -> tuple[int, ...]:
        """Queue the ``spec.n`` sequences of one prompt (OpenAI's ``n`` choices),
        admitted together or not at all, the prompt's full blocks computed once (rule 10).

        Consecutive tickets, one per member. Raises :class:`Infeasible` naming ``n``
        when the slots or an empty pool could not hold the whole group (nothing
        queued), and whatever ``add`` raises for one member.
        """
        self.check_group(spec)
        ids = tuple(self._add(spec) for _ in range(spec.n))
        if spec.n > 1:
            group = _Group([self._seqs[i] for i in ids])
            for seq in group.members:
                seq.group = group
        return ids

    def check_group(self, spec: SequenceSpec) -> None:
        """Raise :class:`Infeasible` if the ``spec.n`` choices of this request could
        never be admitted, whatever else is queued or running; change nothing.
        :meth:`add_group` checks this first; the admission queue asks it before its own
        bound, so a request that can never run is refused as such (a 400), never as a
        queue full that a retry would not cure."""
        n, prompt_len, max_tokens = spec.n, spec.prompt_len, spec.max_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise Infeasible("n", f"n must be an integer >= 1, got {n!r}")
        problem = self._infeasible(
            prompt_len, max_tokens, spec.score_prompt
        ) or self._group_infeasible(prompt_len, max_tokens, n)
        if problem is not None:
            raise problem

    def check_prompts(self, specs: Sequence[SequenceSpec]) -> None:
        """:meth:`check_group` for a list of prompts admitted together (one request of
        ``/v1/completions``): each group alone, then all of them against the slots and
        an empty pool; :class:`Infeasible` names ``prompt`` with the numbers."""
        cfg = self.config
        for spec in specs:
            self.check_group(spec)
        total = sum(spec.n for spec in specs)
        if total > cfg.slots:
            raise Infeasible(
                "prompt",
                f"{len(specs)} prompts of n={specs[0].n} choices are {total} sequences, more "
                f"than the {cfg.slots} slots: a request's choices run together",
            )
        need = 0
        for spec in specs:
            answer = (
                cfg.context_tokens - spec.prompt_len if spec.max_tokens is None else spec.max_tokens
            )
            whole = blocks_for(spec.prompt_len + answer, cfg.block_size)
            need += whole + (spec.n - 1) * (whole - self.kv.shareable_blocks(spec.prompt_len))
        if need > cfg.num_blocks:
            raise Infeasible(
                "prompt",
                f"{len(specs)} prompts of n={specs[0].n} choices need {need} blocks of "
                f"{cfg.block_size} together, but the whole pool has {cfg.num_blocks}",
            )

    def _group_infeasible(
        self, prompt_len: int, max_tokens: int | None, n: int
    ) -> Infeasible | None:
        cfg = self.config
        if n > cfg.slots:
            return Infeasible(
                "n", f"n ({n}) is more than the {cfg.slots} slots: the choices run together"
            )
        answer = cfg.context_tokens - prompt_len if max_tokens is None else max_tokens
        whole = blocks_for(prompt_len + answer, cfg.block_size)
        need = whole + (n - 1) * (whole - self.kv.shareable_blocks(prompt_len))
        if need > cfg.num_blocks:
            return Infeasible(
                "n",
                f"{n} choices of prompt ({prompt_len} tokens) + max_tokens ({answer}) need "
                f"{need} blocks of {cfg.block_size} (the prompt's full blocks counted once), "
                f"but the whole pool has {cfg.num_blocks}",
            )
        return None

    def room(self, spec: SequenceSpec) -> int:
        """The largest ``max_tokens`` each of the ``spec.n`` choices of ``spec``'s prompt
        may have and still pass the door (rule 1, and rule 10 for a group): the largest
        answer the request could be given (``spec.max_tokens`` is not read). Below 1
        when not even one token fits (the door then names the limit the prompt breaks).

        The group's blocks are ``n`` tables less the shared ones counted ``n - 1``
        times too many, so each member may have ``(num_blocks + (n - 1) * shared) // n``.
        """
        cfg = self.config
        n, prompt_len = max(spec.n, 1), spec.prompt_len
        per_member = (cfg.num_blocks + (n - 1) * self.kv.shareable_blocks(prompt_len)) // n
        return min(cfg.context_tokens, per_member * cfg.block_size) - prompt_len

    # -- admission ----------------------------------------------------------------

    def _view(self, seq: _Seq) -> SeqView:
        return SeqView(
            seq_id=seq.seq_id,
            ticket=seq.ticket,
            priority=seq.priority,
            prompt_len=seq.prompt_len,
            n_tokens=len(seq.token_ids),
            max_tokens=seq.max_tokens,
            n_computed=self.kv.computed(seq.seq_id),
            blocks_held=self.kv.n_blocks(seq.seq_id),
            preemptions=seq.preemptions,
            overtaken=seq.overtaken,
        )

    def _scheduler_view(self) -> SchedulerView:
        cfg = self.config
        return SchedulerView(
            block_size=cfg.block_size,
            total_blocks=cfg.num_blocks,
            free_blocks=self.kv.available(),  # cached blocks count: allocate evicts them
            slots=cfg.slots,
            running=len(self._running),
            watermark_blocks=cfg.preempt_watermark_blocks,
            batch_has_run=not self._batch_open,
            last_plan_evicted=self._last_plan_preempted,
        )

    def _admission_blocks(self, seq: _Seq) -> tuple[int, int]:
        """(blocks to take now, extra blocks that must stay free) for ``seq``, checked:
        the blocks taken must hold what its prefill writes, or a chunk would write
        into blocks it does not own."""
        answer = self.policy.admission_blocks(self._view(seq), self._scheduler_view())
        take, keep_free = answer
        bs = self.config.block_size
        # A policy that never grows must take what the whole answer writes.
        least = blocks_for(
            len(seq.token_ids) if self.policy.grows else seq.prompt_len + seq.max_tokens, bs
        )
        if not (isinstance(take, int) and isinstance(keep_free, int)) or take < least:
            raise PolicyError(
                f"policy {policy_name(self.config.policy)}: admission_blocks for seq "
                f"{seq.seq_id} returned {answer!r}; it must take at least {least} block(s) "
                f"(what {'its prefill' if self.policy.grows else 'prompt + answer'} writes, "
                "since it does not grow), and leave >= 0 free"
            )
        return take, max(keep_free, 0)

    def _cache_hits(self, seq: _Seq) -> tuple[int, ...]:
        """The cached blocks its admission would share (rule 9); rule 11: none for a
        prompt still to be scored, since no row may be skipped."""
        return self.kv.computed_blocks(seq.seq_id, seq.token_ids, scoring=seq.scoring)

    def _can_admit(self, seq: _Seq) -> bool:
        members = seq.group.members if seq.group is not None else [seq]
        if len(self._running) + len(members) > self.config.slots:
            return False
        if not self.policy.admits_now(self._scheduler_view()):
            return False
        fresh, keep_free, hits = self._group_need(members)
        # Cached-but-free blocks count as available: allocate evicts them on demand.
        # The hits themselves are not counted twice (available(holding=...)).
        return fresh + keep_free <= self.kv.available(holding=hits)

    def _group_need(self, members: Sequence[_Seq]) -> tuple[int, int, tuple[int, ...]]:
        """(fresh blocks, blocks to leave free, cache hits) to admit ``members`` together:
        the writer's blocks minus its hits, plus each other member's minus the shared
        ones (rule 10); a lone sequence is a group of one. Changes nothing."""
        writer, *others = members
        take, keep_free = self._admission_blocks(writer)
        hits = self._cache_hits(writer)
        fresh = take - len(hits)
        shared = self.kv.shareable_blocks(len(writer.token_ids))
        for other in others:
            take, keep = self._admission_blocks(other)
            fresh += take - shared  # take >= the prompt's blocks > shared (checked)
            keep_free = max(keep_free, keep)
        return fresh, keep_free, hits

    def _ordered_waiting(self) -> list[_Seq]:
        """The waiters in the policy's order (rule 3's head first); checked."""
        waiting = [self._seqs[s] for _, s in self._waiting]
        order = list(self.policy.waiting_order(tuple(self._view(w) for w in waiting)))
        if sorted(order) != sorted(w.seq_id for w in waiting):
            raise PolicyError(
                f"policy {policy_name(self.config.policy)}: waiting_order returned {order}, "
                f"not an order of the waiters {[w.seq_id for w in waiting]}"
            )
        return [self._seqs[s] for s in order]

    def _admit(self, seq: _Seq) -> None:
        """Admit ``seq``, or its whole group (rule 10); ``_can_admit`` said yes."""
        if seq.group is not None:
            self._companions[seq.seq_id] = self._admit_group(seq.group)
            return
        take, _ = self._admission_blocks(seq)
        # Hits + the rest, together; _can_admit said yes a moment ago.
        self.kv.admit(seq.seq_id, len(seq.token_ids), take, self._cache_hits(seq))
        self._enter(seq)

    def _admit_group(self, group: _Group) -> tuple[int, ...]:
        members = list(group.members)
        fresh, keep_free, hits = self._group_need(members)
        if fresh + keep_free > self.kv.available(holding=hits):  # _can_admit said yes
            raise RuntimeError(
                f"admission of group {[m.seq_id for m in members]} found blocks gone"
            )
        # Counted above for the whole group at once, so no admission below can fail.
        writer, *others = members
        take, _ = self._admission_blocks(writer)
        self.kv.admit(writer.seq_id, len(writer.token_ids), take, hits)
        self._enter(writer)
        for other in others:
            take, _ = self._admission_blocks(other)
            self.kv.admit_member(other.seq_id, writer.seq_id, len(other.token_ids), take)
            # The group passed the waiters older than it once (rule 3 counts it as one).
            self._enter(other, overtakes=False)
        for m in members:
            m.group = None  # admitted: from here on each is a sequence of its own
        return tuple(m.seq_id for m in members)

    def _enter(self, seq: _Seq, *, overtakes: bool = True) -> None:
        """The queue's and the slots' bookkeeping of one admission (the KV-cache
        manager has given it its blocks). ``overtakes``: count it against the older
        waiters (False for a group's other members: the group passed once)."""
        self._waiting.remove((seq.ticket, seq.seq_id))
        if overtakes:
            for ticket, sid in self._waiting:  # sorted by ticket: the passed ones come first
                if ticket > seq.ticket:
                    break
                self._seqs[sid].overtaken += 1
        seq.overtaken = 0
        # The prefill starts at the first uncached position (kv.computed); the engine
        # needs nothing else.
        seq.state = SeqState.PREFILLING
        seq.passed = 0
        seq.left_out = False
        seq.admission = self._next_admission
        self._next_admission += 1
        taken = set(self._slot_of.values())
        self._slot_of[seq.seq_id] = min(s for s in range(self.config.slots) if s not in taken)
        self._running.append(seq.seq_id)
        self._admitted_total += 1

    def would_admit(self, seq_id: int) -> bool:
        """Would the policy and the pool admit this waiting sequence now? Changes nothing."""
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.state is SeqState.WAITING and self._can_admit(seq)

    def admit_waiting(self) -> tuple[int, ...]:
        """One pass with bounded overtaking (rule 3); returns the seq_ids admitted.

        Waiters are tried in the policy's order (FCFS: by ticket). The head is
        admitted if it fits. If not, later waiters that fit are admitted, each
        counting one pass against the head, until the head has been passed K times;
        from then on nobody passes it until it is admitted. The order is asked again
        after every admission, since a policy may age waiters by who was admitted.
        """
        admitted: list[int] = []
        k = self.config.overtake_k
        while self._waiting:
            order = self._ordered_waiting()
            head = order[0]
            if self._can_admit(head):
                self._admit(head)
                admitted.append(head.seq_id)
                continue
            follower = None
            if head.passed < k:
                follower = next((f for f in order[1:] if self._can_admit(f)), None)
            if follower is None:
                break
            # Admitting a follower only uses capacity up: the head still cannot fit,
            # and the followers tried before this one still cannot either. A group
            # passes as one (its members arrived together).
            self._admit(follower)
            head.passed += 1
            admitted.append(follower.seq_id)
        # A group's other members entered with the one named (rule 10).
        return tuple(q for a in admitted for q in self._companions.pop(a, (a,)))

    # -- one step -----------------------------------------------------------------

    def plan_step(self) -> StepPlan:
        """Compose the next forward pass (rules 4 and 5). An empty plan: nothing runs.

        Trap: a non-empty plan must be answered by ``commit`` (or dropped with
        ``discard_step``) before the next ``plan_step``.
        """
        if self._inflight is not None:
            raise RuntimeError(
                f"plan_step() called while step {self._inflight.step} is in flight; "
                "commit() or discard_step() it first"
            )
        self._readmit_preempted()
        self._last_plan_preempted = False
        blocked = self._grow()
        cfg = self.config
        order = [self._seqs[s] for s in self._running]  # admission order
        rows: dict[int, int] = {}  # seq_id -> rows this step
        left = cfg.step_rows
        # (a) the promise of rule 4: last step's left-out decoders go first.
        for seq in order:
            if seq.state is SeqState.DECODING and seq.left_out and seq.seq_id not in blocked:
                rows[seq.seq_id] = 1
                left -= 1
        # (b) prefill chunks: a waiting caller measures time to first token. While
        # any sequence decodes, stall_rows bounds the prefill rows of the whole step,
        # not of each prompt: a step's prefill is every decoder's stall, so the rows
        # past it are held back for the decoders. Hazard: with a per-prompt bound, a
        # wave of prompts filled the step (prompt A's chunk and B's first rows),
        # pushed the decoders out, and each stream got a token every second step of
        # a full chunk: served ITL p99 2.4x llama-server's (8 streams, Qwen2.5-1.5B).
        # A step with no decoder stalls nobody and fills step_rows with chunks.
        held = 0
        if any(s.state is SeqState.DECODING and s.seq_id not in blocked for s in order):
            held = max(left - cfg.stall_rows, 0)
        left -= held
        for seq in order:
            if seq.state is SeqState.PREFILLING and left > 0:
                if not self.kv.ready(seq.seq_id):
                    continue  # rule 10: its group's writer has not written what it reads
                n = min(cfg.chunk_tokens, len(seq.token_ids) - self.kv.computed(seq.seq_id), left)
                rows[seq.seq_id] = n
                left -= n
        left += held  # the decoders' rows
        # (c) one decode row each, in the policy's order, while rows last.
        for seq in self._decode_order([s for s in order if s.state is SeqState.DECODING]):
            if left == 0:
                break
            if seq.seq_id not in (rows.keys() | blocked):
                rows[seq.seq_id] = 1
                left -= 1
        for seq in order:
            seq.left_out = seq.seq_id not in rows and seq.seq_id not in blocked
        if not rows:
            return self._empty_plan()
        self._deadlock = None
        self._step += 1
        self._batch_open = False  # static: the batch is closed once it has run
        chunks = [self._chunk(seq, rows[seq.seq_id]) for seq in order if seq.seq_id in rows]
        # Prefill chunks first, then decode rows (the StepPlan contract).
        chunks.sort(key=lambda c: not c.prefill)
        plan = StepPlan(step=self._step, chunks=tuple(chunks))
        self._inflight = plan
        return plan

    def _decode_order(self, decoding: list[_Seq]) -> list[_Seq]:
        order = list(self.policy.decode_order(tuple(self._view(d) for d in decoding)))
        if sorted(order) != sorted(d.seq_id for d in decoding):
            raise PolicyError(
                f"policy {policy_name(self.config.policy)}: decode_order returned {order}, "
                f"not an order of the decoding sequences {[d.seq_id for d in decoding]}"
            )
        return [self._seqs[s] for s in order]

    def _chunk(self, seq: _Seq, n: int) -> ChunkPlan:
        start = self.kv.computed(seq.seq_id)
        if seq.state is SeqState.DECODING:
            return ChunkPlan(
                seq_id=seq.seq_id,
                token_ids=(seq.token_ids[start],),
                start=start,
                block_table=self.kv.blocks(seq.seq_id),
                sample=True,
                prefill=False,
            )
        end = start + n
        return ChunkPlan(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.token_ids[start:end]),
            start=start,
            block_table=self.kv.blocks(seq.seq_id),
            # only the final chunk's logits are a new token (none with max_tokens 0)
            sample=end == len(seq.token_ids) and seq.max_tokens > 0,
            prefill=True,
            # rule 11: each row's next prompt token (the final row's is the answer's)
            score_ids=tuple(seq.token_ids[start + 1 : min(end + 1, seq.prompt_len)])
            if seq.scoring
            else (),
        )

    def _empty_plan(self) -> StepPlan:
        if self._running and not any(self._can_admit(self._seqs[s]) for _, s in self._waiting):
            self._deadlock = self._report()
            if Claim.NO_DEADLOCK in self.policy.claims:
                raise DeadlockError(self._deadlock, policy_name(self.config.policy))
        return StepPlan(step=self._step, chunks=())

    def _grow(self) -> set[int]:
        """Give every decoding sequence the block its next row writes into (rule 5).

        Returns the seq_ids that must wait for a block (free-slot only). Oldest
        ticket first, so under ``preempt`` the oldest running sequence is served
        first and is never the victim while anyone younger runs.
        """
        cfg = self.config
        blocked: set[int] = set()
        decoding = [self._seqs[s] for s in self._running]
        for seq in sorted(decoding, key=lambda s: s.ticket):
            if seq.state is not SeqState.DECODING:
                continue  # prefilling (its blocks were taken at admission) or just preempted
            sid = seq.seq_id
            need = blocks_for(self.kv.computed(sid) + 1, cfg.block_size) - self.kv.n_blocks(sid)
            if need <= 0:
                continue
            if not self.policy.grows:
                raise RuntimeError(f"seq {sid} outgrew its reservation")
            got = self.kv.grow(sid, need)
            while not got:
                victim = self._victim(seq)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is seq:
                    break
                got = self.kv.grow(sid, need)
            if not got and seq.state is SeqState.DECODING:
                blocked.add(sid)
        return blocked

    def _victim(self, needing: _Seq) -> _Seq | None:
        """Whom the policy evicts for ``needing`` (None: it waits for a block); checked."""
        running = tuple(self._view(self._seqs[s]) for s in self._running)
        victim = self.policy.on_dry_pool(self._view(needing), running)
        if victim is not None and victim not in self._running:
            raise PolicyError(
                f"policy {policy_name(self.config.policy)}: on_dry_pool chose {victim!r}, "
                f"which is not a running sequence {list(self._running)}"
            )
        return None if victim is None else self._seqs[victim]

    def _preempt(self, seq: _Seq) -> None:
        # Recompute, not swap: drop the K/V, keep the token ids and the ticket.
        self._release(seq)
        seq.state = SeqState.WAITING
        seq.preemptions += 1
        seq.left_out = False
        bisect.insort(self._waiting, (seq.ticket, seq.seq_id))
        self._preemptions_total += 1
        self._last_plan_preempted = True

    def _readmit_preempted(self) -> None:
        # A preempted sequence is readmitted only while it is the head of the queue,
        # so readmission never overtakes anyone (rule 3 holds without counting).
        while self._waiting:
            head = self._ordered_waiting()[0]
            if not head.preemptions or not self._can_admit(head):
                return
            self._admit(head)

    def commit(self, result: StepResult) -> tuple[Finished, ...]:
        """Apply one step's result: advance positions, append tokens, end sequences.

        A sequence ends on a stop token id or a token that completes its grammar
        (``STOP``), or on reaching ``max_tokens``
        (``LENGTH``; the context can never be the tighter limit, rule 1). Its blocks
        are back in the pool before this returns. Results for sequences no longer
        running (cancelled or finished while the step ran) are ignored.
        """
        plan = self._inflight
        if plan is None:
            raise RuntimeError("commit() without a plan in flight")
        if result.step != plan.step:
            raise ValueError(f"result for step {result.step}, but step {plan.step} is in flight")
        sampled = {t.seq_id: t for t in result.sampled}
        failed = {f.seq_id for f in result.failed}
        live = [
            c
            for c in plan.chunks
            if (s := self._seqs.get(c.seq_id)) is not None and s.state in RUNNING_STATES
        ]
        missing = [
            c.seq_id
            for c in live
            if c.sample and c.seq_id not in sampled and c.seq_id not in failed
        ]
        if missing:  # checked before anything changes, so a bad result leaves no trace
            raise ValueError(f"step {plan.step} sampled no token for sequence(s) {missing}")
        self._inflight = None
        finished: list[Finished] = []
        for chunk in live:
            seq = self._seqs[chunk.seq_id]
            if seq.seq_id in failed:
                # No token: nothing advances, so if its owner did not cancel it the
                # same rows would simply be planned again.
                continue
            # The K/V is written: the manager publishes the newly full blocks (rule 9).
            self.kv.commit(seq.seq_id, chunk.start + chunk.n_rows, seq.token_ids)
            if not chunk.sample:
                scored = self.kv.computed(seq.seq_id) == seq.prompt_len
                if seq.max_tokens == 0 and scored:  # rule 11: scored
                    finished.append(self._end(seq, SeqState.FINISHED, FinishReason.LENGTH))
                continue
            tok = sampled[seq.seq_id]
            seq.token_ids.append(tok.token_id)
            seq.state = SeqState.DECODING
            if seq.first_token_step is None:
                seq.first_token_step = plan.step
            if tok.token_id in seq.stop_ids or tok.completes:
                finished.append(self._end(seq, SeqState.FINISHED, FinishReason.STOP))
            elif seq.n_generated >= seq.max_tokens:
                finished.append(self._end(seq, SeqState.FINISHED, FinishReason.LENGTH))
        return tuple(finished)

    def discard_step(self) -> None:
        """Forget the plan in flight without applying it (its run failed).

        Nothing it planned advanced, so the same rows will be planned again.
        """
        self._inflight = None

    # -- ending -------------------------------------------------------------------

    def finish(self, seq_id: int, reason: FinishReason = FinishReason.STOP) -> None:
        """End a sequence early (a stop string matched); its blocks go back now.

        Idempotent; an ended or forgotten sequence is left alone.
        """
        if reason is FinishReason.CANCELLED:
            self.cancel(seq_id)
            return
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._check_known(seq_id)
            return
        self._end(seq, SeqState.FINISHED, reason)

    def cancel(self, seq_id: int) -> None:
        """Drop a sequence in any state; its blocks are back in the pool on return.

        Idempotent. Trap: a step already running may still produce a token for it;
        ``commit`` ignores that token.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._check_known(seq_id)
            return
        self._end(seq, SeqState.CANCELLED, FinishReason.CANCELLED)

    def _end(self, seq: _Seq, state: SeqState, reason: FinishReason) -> Finished:
        if seq.group is not None:  # it waited in a group: the rest stays one group
            seq.group.members.remove(seq)
            if len(seq.group.members) == 1:
                seq.group.members[0].group = None
            seq.group = None
        if seq.state is SeqState.WAITING:
            self._waiting.remove((seq.ticket, seq.seq_id))
        else:
            self._release(seq)
        seq.state = state
        del self._seqs[seq.seq_id]
        self.kv.forget(seq.seq_id)
        self._terminal[seq.seq_id] = state
        if len(self._terminal) > _TERMINAL_MEMORY:
            self._terminal.popitem(last=False)
        if state is SeqState.CANCELLED:
            self._cancelled_total += 1
        else:
            self._finished_total += 1
        return Finished(seq.seq_id, reason, seq.n_generated)

    def _release(self, seq: _Seq) -> None:
        """Give a running sequence's blocks (a group's writer hands its writing over,
        rule 10) and slot back.

        Hazard (K/V reuse across threads): a block freed by a cancel while a step runs
        can be handed to a new sequence while the worker thread is still writing the
        old owner's K/V into it. That is safe only because (a) exactly one plan is in
        flight (``plan_step`` refuses a second), so the new owner is first planned
        after that step commits or is discarded; (b) a sequence's first chunk starts
        at its first unshared position, and ``forward`` writes a row's K/V before any
        row attends (``llama.py``), so the new owner overwrites every position of a
        fresh block before it reads it; (c) attention reads only positions the owner
        computed itself or shares as published, never-rewritten blocks. A second plan
        in flight, or a worker left running after cancellation
        (``abandon_on_cancel=True``), breaks it silently. Test:
        ``tests/test_scheduler.py::test_a_block_freed_mid_step_is_rewritten_by_its_new_owner_before_it_is_read``.
        """
        self.kv.free(seq.seq_id)
        self._running.remove(seq.seq_id)
        del self._slot_of[seq.seq_id]
        self._deadlock = None  # blocks came back: the next plan_step re-judges
        if not self._running:
            self._batch_open = True

    def _check_known(self, seq_id: int) -> None:
        if not 0 <= seq_id < self._next_id:
            raise KeyError(seq_id)

    # -- looking ------------------------------------------------------------------

    def state(self, seq_id: int) -> SeqState:
        """The sequence's state; ``KeyError`` for an id never issued or forgotten."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            return seq.state
        return self._terminal[seq_id]

    def sequence(self, seq_id: int) -> SequenceInfo:
        """A snapshot of a live (waiting or running) sequence; ``KeyError`` otherwise."""
        seq = self._seqs[seq_id]
        return SequenceInfo(
            seq_id=seq.seq_id,
            ticket=seq.ticket,
            priority=seq.priority,
            state=seq.state,
            slot=self._slot_of.get(seq_id),
            prompt_len=seq.prompt_len,
            n_generated=seq.n_generated,
            n_computed=self.kv.computed(seq_id),
            max_tokens=seq.max_tokens,
            blocks=self.kv.blocks(seq_id),
            first_token_step=seq.first_token_step,
            preemptions=seq.preemptions,
            cached_tokens=self.kv.cached_tokens(seq_id),
            waits_for=self.kv.waits_for(seq_id),
        )

    def token_ids(self, seq_id: int) -> tuple[int, ...]:
        """Prompt + generated token ids of a live sequence."""
        return tuple(self._seqs[seq_id].token_ids)

    def running_ids(self) -> tuple[int, ...]:
        """Running seq_ids in admission order."""
        return tuple(self._running)

    def waiting_ids(self) -> tuple[int, ...]:
        """Waiting seq_ids in ticket order (the head first)."""
        return tuple(s for _, s in self._waiting)

    def waiting_order(self) -> tuple[int, ...]:
        """Waiting seq_ids in the order the policy tries them (FCFS: ``waiting_ids``)."""
        return tuple(w.seq_id for w in self._ordered_waiting()) if self._waiting else ()

    def deadlock_report(self) -> DeadlockReport | None:
        """The current deadlock (free-slot only), or None."""
        return self._deadlock

    def _report(self) -> DeadlockReport:
        bs = self.config.block_size
        kv = self.kv
        holders = tuple(
            Holder(
                seq_id=s,
                blocks=kv.blocks(s),
                n_computed=kv.computed(s),
                blocks_needed=blocks_for(kv.computed(s) + 1, bs) - kv.n_blocks(s),
            )
            for s in self._running
        )
        return DeadlockReport(
            step=self._step,
            holders=holders,
            waiting=self.waiting_ids(),
            free_blocks=self.kv.available(),
        )

    def statistics(self) -> SchedulerStatistics:
        pool = self.pool.statistics()
        cache = self.kv.statistics()
        states = [self._seqs[s].state for s in self._running]
        return SchedulerStatistics(
            policy=self.config.policy,
            step=self._step,
            waiting=len(self._waiting),
            running=len(self._running),
            prefilling=states.count(SeqState.PREFILLING),
            decoding=states.count(SeqState.DECODING),
            free_slots=self.config.slots - len(self._running),
            blocks_total=pool.total,
            blocks_free=pool.available,
            blocks_held=pool.held,
            blocks_cached=pool.cached,
            deadlocked=self._deadlock is not None,
            admitted_total=self._admitted_total,
            finished_total=self._finished_total,
            cancelled_total=self._cancelled_total,
            preemptions_total=self._preemptions_total,
            prefix_cache_queries_total=cache.queries_total,
            prefix_cache_hits_total=cache.hits_total,
        )
