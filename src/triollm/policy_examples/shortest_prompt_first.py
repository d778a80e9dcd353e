"""Shortest prompt first: short requests get their first token sooner; long ones starve.

Admitting the shortest waiting prompt first lowers the mean time to first token
(the same reason shortest-job-first lowers mean waiting time). But a long prompt
that keeps meeting shorter newcomers is never first, and the Scheduler's
overtaking limit K only protects whoever the policy puts first:
``triollm check-policy triollm.policy_examples.shortest_prompt_first:ShortestPromptFirst``
finds the long prompt passed again and again, past the bound it hopes for.
``Aged`` fixes it: a waiter that later arrivals have passed ``aging`` times goes
to the front, so the oldest waiter is passed at most ``aging + K`` times, and
the harness proves that bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from triollm.policies import BasePolicy, Claim, SeqView


class ShortestPromptFirst(BasePolicy):
    name = "shortest-prompt-first"
    description = "admit the shortest waiting prompt first (no aging: long prompts can starve)"
    # It reserves like `reserve`, so it makes the same claims; and it hopes a long
    # prompt waits for at most three short ones more than the Scheduler's K allows.
    claims = frozenset(Claim) - {Claim.LIVENESS_OF_THE_OLDEST}

    def overtake_bound(self, overtake_limit: int) -> int:
        return overtake_limit + 3

    def waiting_order(self, waiting: Sequence[SeqView]) -> Sequence[int]:
        return [s.seq_id for s in sorted(waiting, key=lambda s: (s.prompt_len, s.ticket))]


class Aged(ShortestPromptFirst):
    name = "shortest-prompt-first-aged"
    description = "shortest prompt first, but a waiter passed `aging` times goes first"
    aging = 2  # passes by later arrivals before a waiter jumps the line

    def waiting_order(self, waiting: Sequence[SeqView]) -> Sequence[int]:
        aged = [s for s in waiting if s.overtaken >= self.aging]  # already in arrival order
        young = sorted(
            (s for s in waiting if s.overtaken < self.aging), key=lambda s: (s.prompt_len, s.ticket)
        )
        return [s.seq_id for s in (*aged, *young)]

    def overtake_bound(self, overtake_limit: int) -> int:
        # At most `aging` passes while it is young; then it is first, and the
        # Scheduler lets at most K more waiters pass a head that does not fit.
        return self.aging + overtake_limit
