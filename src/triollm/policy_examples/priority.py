"""Priority scheduling with an aging bound: smaller ``priority`` goes first.

Requests carry a ``priority`` (the HTTP body's ``priority``, or
``Scheduler.add(..., priority=)``; vLLM's priority scheduling uses the same
convention: a smaller value is served earlier, ties in arrival order). It says
``orders_by_priority``, so the server accepts a non-zero one under it. Waiters
are tried in priority order, and when a step's rows are tight the lower-priority
decoders are the ones left out (they still get a row in the very next step: the
Scheduler's rule 4). Without aging a stream of urgent
requests would starve everyone else; here a waiter that later arrivals have
passed ``aging`` times is tried first, so the oldest waiter is passed at most
``aging + K`` times. ``triollm check-policy
triollm.policy_examples.priority:PriorityWithAging`` proves it.
"""

from __future__ import annotations

from collections.abc import Sequence

from triollm.policies import BasePolicy, Claim, SeqView


class PriorityWithAging(BasePolicy):
    name = "priority"
    description = "smaller priority first, FCFS within one; a waiter passed 3 times goes first"
    claims = frozenset(Claim) - {Claim.LIVENESS_OF_THE_OLDEST}
    orders_by_priority = True  # so the server accepts a request's non-zero priority
    aging = 3  # passes by later arrivals before a waiter is tried first

    def waiting_order(self, waiting: Sequence[SeqView]) -> Sequence[int]:
        aged = [s for s in waiting if s.overtaken >= self.aging]  # already in arrival order
        rest = sorted(
            (s for s in waiting if s.overtaken < self.aging), key=lambda s: (s.priority, s.ticket)
        )
        return [s.seq_id for s in (*aged, *rest)]

    def decode_order(self, decoding: Sequence[SeqView]) -> Sequence[int]:
        # A stable sort: admission order within one priority.
        return [s.seq_id for s in sorted(decoding, key=lambda s: s.priority)]

    def overtake_bound(self, overtake_limit: int) -> int:
        return self.aging + overtake_limit
