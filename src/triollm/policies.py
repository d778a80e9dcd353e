"""The four admission policies: what each one decides, in one place.

The :class:`~triollm.scheduler.Scheduler` runs the same loop for every policy; the
policy answers three questions, and this module is where the answers live:

1. How many blocks does admission take, and how many must it leave free?
   (:func:`admission_blocks`)
2. May a running sequence take more blocks later, and what happens when the
   pool is dry? (:attr:`Policy.grows`, :attr:`Policy.evicts`)
3. May the batch take new members now? (:attr:`Policy.batches_whole_requests`:
   only ``static`` says "not until the whole batch has ended")

| policy      | admission takes                 | grows | dry pool        | deadlock |
| ----------- | ------------------------------- | ----- | --------------- | -------- |
| static      | prompt + answer, batch at a time| no    | cannot happen   | never    |
| reserve     | prompt + answer                 | no    | cannot happen   | never    |
| free-slot   | prompt                          | yes   | the row waits   | possible |
| preempt     | prompt (+ recompute), watermark | yes   | evict youngest  | never    |

docs/scheduling.md explains why each exists and what breaks without it. Pure
stdlib, like the Scheduler.
"""

from __future__ import annotations

import enum

from triollm.kv import blocks_for


class Policy(enum.Enum):
    """How the Scheduler admits and grows sequences."""

    STATIC = "static"  # request-level batching: a new batch only after the whole last one ends
    RESERVE = "reserve"  # continuous batching, reserving prompt + answer at admission (default)
    FREE_SLOT = "free-slot"  # admit on a free slot + the prompt's blocks; can deadlock
    PREEMPT = "preempt"  # prompt + watermark; evict the latest arrival when the pool runs dry

    @property
    def reserves_answer(self) -> bool:
        """Admission takes the blocks of the whole answer, so growth never allocates."""
        return self in (Policy.STATIC, Policy.RESERVE)

    @property
    def grows(self) -> bool:
        """A decode row that crosses into a new block allocates it then."""
        return not self.reserves_answer

    @property
    def evicts(self) -> bool:
        """A dry pool preempts the youngest running sequence instead of waiting."""
        return self is Policy.PREEMPT

    @property
    def can_deadlock(self) -> bool:
        """Every running sequence may wait for a block that nobody can free."""
        return self is Policy.FREE_SLOT

    @property
    def batches_whole_requests(self) -> bool:
        """New members join only a batch that has not run yet (request-level batching)."""
        return self is Policy.STATIC


def admission_blocks(
    policy: Policy,
    *,
    prompt_len: int,
    n_tokens: int,
    max_tokens: int,
    block_size: int,
    watermark_blocks: int,
) -> tuple[int, int]:
    """(blocks to take now, further blocks that must stay free) to admit a sequence.

    ``n_tokens`` is what its prefill will compute: the prompt, plus the tokens it
    generated before a preemption. Trap: the preempt watermark is capped at what
    the whole request still needs, so an empty pool always admits (the door has
    checked that the whole request fits the pool); otherwise the oldest sequence
    could be locked out forever by a watermark larger than its remaining need.
    """
    whole = blocks_for(prompt_len + max_tokens, block_size)
    if policy.reserves_answer:
        return whole, 0
    now = blocks_for(n_tokens, block_size)
    if policy is Policy.FREE_SLOT:
        return now, 0
    return now, min(watermark_blocks, whole - now)
