"""A deliberately broken policy, for proving that ``check-policy`` catches a leak.

It reserves like ``reserve``, and when the pool has room it takes one spare block
per sequence "for speculative decoding later". Nothing ever writes that block: it
is held from admission to the end, withdrawn from everyone else, which is what a
leak is to a KV pool. The Scheduler cannot refuse it (taking more than needed is
not unsafe, only wasteful); the ``blocks-conserved`` claim is what catches it.
"""

from __future__ import annotations

from triollm.kv import blocks_for
from triollm.policies import Reserve, SchedulerView, SeqView


class SpareBlock(Reserve):
    name = "spare-block"
    description = "reserve, plus a spare block when there is room (never written: a leak)"

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]:
        whole = blocks_for(seq.prompt_len + seq.max_tokens, view.block_size)
        spare = 1 if view.free_blocks > whole else 0
        return whole + spare, 0
