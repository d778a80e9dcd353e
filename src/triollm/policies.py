"""Scheduling policies: the decisions the Scheduler leaves open, as a small interface.

The :class:`~triollm.scheduler.Scheduler` runs one loop for every policy and is
the only owner of blocks, slots, tickets and the step. A policy owns nothing: it
answers six questions from frozen views, and declares which claims it makes.

1. ``admission_blocks(seq, view)``: how many blocks does admission take now, and
   how many more must it leave free?
2. ``grows``: may a running sequence take more blocks later (one when a decode
   row crosses into a new block)?
3. ``on_dry_pool(needing, running)``: a decode row needs a block and none is
   free: evict whom (a running seq_id; it is recomputed later), or ``None``: the
   row waits for a block.
4. ``admits_now(view)``: may the batch take new members now?
5. ``waiting_order(waiting)``: the order in which waiters are tried. The first
   is the *head*: while it does not fit, later ones may pass it at most
   ``overtake_limit`` times (the Scheduler's rule 3).
6. ``decode_order(decoding)``: the order decoding sequences get their rows; when
   a step's row budget is tight, the last ones are left out (and go first in the
   next step, the Scheduler's rule 4).

``claims`` names what ``triollm check-policy`` proves about it (:class:`Claim`), and
``orders_by_priority`` says whether any answer reads ``SeqView.priority``: the
server refuses a request's non-zero ``priority`` under a policy that would ignore it
(``Service.submit``), as vLLM refuses one without its priority scheduling.

The four built-in policies are the four classes below; :class:`Policy` names them.

| policy      | admission takes                 | grows | dry pool        | deadlock |
| ----------- | ------------------------------- | ----- | --------------- | -------- |
| static      | prompt + answer, batch at a time| no    | cannot happen   | never    |
| reserve     | prompt + answer                 | no    | cannot happen   | never    |
| free-slot   | prompt                          | yes   | the row waits   | possible |
| preempt     | prompt (+ recompute), watermark | yes   | evict youngest  | never    |

docs/scheduling.md explains why each exists and what breaks without it;
docs/policies.md walks through writing one. Pure stdlib, like the Scheduler.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from triollm.kv import blocks_for

__all__ = [
    "BasePolicy",
    "Claim",
    "FreeSlot",
    "Policy",
    "PolicyError",
    "Preempt",
    "Reserve",
    "SchedulerView",
    "SchedulingPolicy",
    "SeqView",
    "Static",
    "builtin",
    "load_policy",
    "missing_members",
    "policy_name",
]


class Claim(enum.Enum):
    """What a policy promises; ``triollm check-policy`` checks exactly the claimed ones."""

    BLOCKS_CONSERVED = "blocks-conserved"  # free + held = total = live tables; none unreachable
    EXCLUSIVE_BLOCKS = "exclusive-blocks"  # no block has two live owners
    NO_DEADLOCK = "no-deadlock"  # something can always move (the free-slot detector never fires)
    BOUNDED_OVERTAKING = "bounded-overtaking"  # FCFS: the oldest waiter is passed a bounded number
    LIVENESS = "liveness"  # every admitted sequence ends within the stated bound
    LIVENESS_OF_THE_OLDEST = "liveness-of-the-oldest"  # ... only the oldest live one (evicting)

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    Claim.BLOCKS_CONSERVED: "blocks are conserved: free + held = total = the blocks in live "
    "tables, and no table holds a block its sequence can never write",
    Claim.EXCLUSIVE_BLOCKS: "no block has two live owners",
    Claim.NO_DEADLOCK: "no deadlock: while a sequence runs every step computes a row, "
    "and an idle scheduler admits its queue",
    Claim.BOUNDED_OVERTAKING: "FCFS with bounded overtaking: the oldest waiter is passed "
    "at most overtake_bound(K) times",
    Claim.LIVENESS: "every admitted sequence ends within the liveness bound (docs/scheduling.md)",
    Claim.LIVENESS_OF_THE_OLDEST: "the oldest live sequence, once running, ends within the "
    "liveness bound",
}


@dataclass(frozen=True, slots=True)
class SeqView:
    """What a policy sees of one sequence (a snapshot; changing it changes nothing)."""

    seq_id: int
    ticket: int  # arrival order, kept across preemption: smaller arrived earlier
    priority: int  # the request's priority; smaller goes first (vLLM's convention); default 0
    prompt_len: int
    n_tokens: int  # prompt + generated: what a (re)prefill computes
    max_tokens: int  # the resolved answer budget
    n_computed: int  # positions whose K/V is written (0 while waiting)
    blocks_held: int  # 0 while waiting
    preemptions: int
    overtaken: int  # later arrivals admitted while it waited (since its last admission)


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """What a policy sees of the Scheduler when it decides (a snapshot)."""

    block_size: int  # positions per block
    total_blocks: int
    free_blocks: int
    slots: int
    running: int  # sequences admitted and not ended
    watermark_blocks: int  # SchedulerConfig.preempt_watermark_blocks
    batch_has_run: bool  # a step has run since the batch was last empty
    last_plan_evicted: bool  # the last plan_step preempted someone


class PolicyError(Exception):
    """A policy answered outside the interface (a victim that is not running, an order
    that is not a permutation, fewer blocks than the prefill writes). The Scheduler
    checks every answer before acting on it, so a bad policy cannot corrupt the pool."""


@runtime_checkable
class SchedulingPolicy(Protocol):
    """The interface (see the module docstring). Subclass :class:`BasePolicy` to get
    the FCFS, reserving defaults and override what you decide differently."""

    name: str  # shown in tables, metrics and reports
    description: str  # one line
    claims: frozenset[Claim]
    grows: bool
    deterministic: bool  # same events in, same decisions out (check-policy then writes a replay)
    orders_by_priority: bool  # some answer reads SeqView.priority (else the server refuses one)

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]: ...

    def on_dry_pool(self, needing: SeqView, running: Sequence[SeqView]) -> int | None: ...

    def admits_now(self, view: SchedulerView) -> bool: ...

    def waiting_order(self, waiting: Sequence[SeqView]) -> Sequence[int]: ...

    def decode_order(self, decoding: Sequence[SeqView]) -> Sequence[int]: ...

    def overtake_bound(self, overtake_limit: int) -> int: ...


_ATTRIBUTES = ("name", "description", "claims", "grows", "deterministic", "orders_by_priority")
_METHODS = (
    "admission_blocks",
    "on_dry_pool",
    "admits_now",
    "waiting_order",
    "decode_order",
    "overtake_bound",
)


def missing_members(obj: object) -> list[str]:
    """What ``obj`` lacks to be a :class:`SchedulingPolicy` (empty: it is one)."""
    missing = [a for a in _ATTRIBUTES if not hasattr(obj, a)]
    missing += [f"{m}()" for m in _METHODS if not callable(getattr(obj, m, None))]
    if hasattr(obj, "claims"):
        claims = obj.claims
        is_set = isinstance(claims, (set, frozenset))
        if not is_set or not all(isinstance(c, Claim) for c in claims):
            missing.append("claims as a set of Claim members")
    for flag in ("grows", "orders_by_priority"):
        if hasattr(obj, flag) and not isinstance(getattr(obj, flag), bool):
            missing.append(f"{flag} as a bool")
    return missing


class BasePolicy:
    """Defaults for every decision: reserve prompt + answer, never grow, never evict,
    always take members, FCFS, decode rows in admission order. Subclass and override.

    Views arrive in a fixed order: waiters by ticket (arrival), decoders by admission.
    """

    name: str = "base"
    description: str = "reserve prompt + answer at admission, first come first served"
    claims: frozenset[Claim] = frozenset()
    grows: bool = False
    deterministic: bool = True
    orders_by_priority: bool = False  # set it when an answer reads SeqView.priority

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]:
        return blocks_for(seq.prompt_len + seq.max_tokens, view.block_size), 0

    def on_dry_pool(self, needing: SeqView, running: Sequence[SeqView]) -> int | None:
        return None

    def admits_now(self, view: SchedulerView) -> bool:
        return True

    def waiting_order(self, waiting: Sequence[SeqView]) -> Sequence[int]:
        return [s.seq_id for s in waiting]

    def decode_order(self, decoding: Sequence[SeqView]) -> Sequence[int]:
        return [s.seq_id for s in decoding]

    def overtake_bound(self, overtake_limit: int) -> int:
        """How many times the oldest waiter may be passed (the BOUNDED_OVERTAKING claim)."""
        return overtake_limit

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


_EVERYTHING = frozenset(Claim) - {Claim.LIVENESS_OF_THE_OLDEST}


class Reserve(BasePolicy):
    """Continuous batching; admission takes the blocks of prompt + answer together, so an
    admitted sequence can always finish (the server's default)."""

    name = "reserve"
    description = "continuous batching, reserving prompt + answer blocks at admission"
    claims = _EVERYTHING


class Static(Reserve):
    """Request-level batching: new members join only a batch that has not run yet."""

    name = "static"
    description = "request-level batching: a new batch only when the whole last one ended"

    def admits_now(self, view: SchedulerView) -> bool:
        return not view.batch_has_run


class FreeSlot(BasePolicy):
    """Admit on a free slot and the prompt's blocks; grow a block at a time; a dry pool
    makes the row wait. Can deadlock (here to be compared, and to prove the harness)."""

    name = "free-slot"
    description = "continuous batching, admitting on a free slot and the prompt alone"
    claims = frozenset({Claim.BLOCKS_CONSERVED, Claim.EXCLUSIVE_BLOCKS, Claim.BOUNDED_OVERTAKING})
    grows = True

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]:
        return blocks_for(seq.n_tokens, view.block_size), 0


class Preempt(BasePolicy):
    """Take the prompt (+ recomputed tokens) and leave a watermark free; grow on demand;
    a dry pool evicts the latest arrival, which recomputes when readmitted."""

    name = "preempt"
    description = "prompt + watermark at admission; evict the latest arrival when dry"
    claims = (_EVERYTHING - {Claim.LIVENESS}) | {Claim.LIVENESS_OF_THE_OLDEST}
    grows = True

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]:
        # Trap: the watermark is capped at what the whole request still needs, so an
        # empty pool always admits (the door has checked that the whole request fits);
        # otherwise the oldest could be locked out by a watermark larger than its need.
        whole = blocks_for(seq.prompt_len + seq.max_tokens, view.block_size)
        now = blocks_for(seq.n_tokens, view.block_size)
        return now, min(view.watermark_blocks, whole - now)

    def on_dry_pool(self, needing: SeqView, running: Sequence[SeqView]) -> int | None:
        # The youngest by arrival ticket: never the oldest while anyone younger runs.
        return max(running, key=lambda s: s.ticket).seq_id

    def admits_now(self, view: SchedulerView) -> bool:
        # vLLM's rule: a step that had to evict admits nobody. Hazard: only while
        # something runs. If the survivor finished in that step, an idle scheduler
        # that refused would wait for a step that never comes (the property test
        # found exactly that).
        return not (view.last_plan_evicted and view.running)


class Policy(enum.Enum):
    """The names of the four built-in policies (``--policy reserve``)."""

    STATIC = "static"  # request-level batching: a new batch only after the whole last one ends
    RESERVE = "reserve"  # continuous batching, reserving prompt + answer at admission (default)
    FREE_SLOT = "free-slot"  # admit on a free slot + the prompt's blocks; can deadlock
    PREEMPT = "preempt"  # prompt + watermark; evict the latest arrival when the pool runs dry

    @property
    def implementation(self) -> SchedulingPolicy:
        return builtin(self)


_BUILTIN: dict[Policy, SchedulingPolicy] = {
    Policy.STATIC: Static(),
    Policy.RESERVE: Reserve(),
    Policy.FREE_SLOT: FreeSlot(),
    Policy.PREEMPT: Preempt(),
}


def builtin(policy: Policy) -> SchedulingPolicy:
    """The object behind a built-in policy's name."""
    return _BUILTIN[policy]


def policy_name(policy: Policy | SchedulingPolicy) -> str:
    return policy.value if isinstance(policy, Policy) else policy.name


def load_policy(spec: str) -> SchedulingPolicy:
    """A policy from ``reserve`` (a built-in), ``package.module:Name`` or ``file.py:Name``.

    ``Name`` may be a class (instantiated with no arguments) or an object. The current
    directory is importable, as with ``python -m``. Raises ``ValueError`` with what is
    wrong: a module that does not import, a missing name, or the members it lacks.
    """
    try:
        return builtin(Policy(spec))
    except ValueError:
        pass
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        names = ", ".join(p.value for p in Policy)
        raise ValueError(f"policy must be one of {names} or module:Name, got {spec!r}")
    module = _import(module_name, spec)
    try:
        obj: Any = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"policy {spec}: {module_name} has no attribute {attr!r}") from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except TypeError as exc:
            raise ValueError(
                f"policy {spec}: the class must be callable with no arguments ({exc})"
            ) from None
    missing = missing_members(obj)
    if missing:
        raise ValueError(
            f"policy {spec} is not a scheduling policy: it lacks {', '.join(missing)} "
            "(see triollm.policies.SchedulingPolicy, or subclass BasePolicy)"
        )
    return obj  # type: ignore[no-any-return]


def _import(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"policy {spec}: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module  # dataclasses and pickling look the module up
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[path.stem]
            raise ValueError(f"policy {spec}: {path} failed to import: {exc!r}") from exc
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: a module in the current directory
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"policy {spec}: cannot import {module_name} ({exc})") from None
