"""The Scheduler's claims, checked by hypothesis over arbitrary configs and events.

Each built-in policy gets the same state machine (``triollm.check.machine``, the
one ``triollm check-policy`` runs), which checks exactly the claims the policy
makes. ``reserve``, ``static`` and ``preempt`` claim everything, liveness
included; ``free-slot`` claims the safety properties, and a search that adds the
``no-deadlock`` claim must *find* its deadlock, which shows the claim can fail
and so means something when it holds.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from triollm.check.machine import machine_for
from triollm.policies import Claim, FreeSlot, Policy

TestReserve = machine_for(Policy.RESERVE).TestCase
TestStatic = machine_for(Policy.STATIC).TestCase
TestPreempt = machine_for(Policy.PREEMPT).TestCase
# No cancels: sequences live long and the pool runs dry more often.
TestPreemptUnderPressure = machine_for(Policy.PREEMPT, ends_early=False).TestCase
TestFreeSlotSafety = machine_for(Policy.FREE_SLOT).TestCase

# The same claims with the prefix cache on (shared openings, salts, hits on cached
# blocks), plus its own: refcounts = live holders, one writer, hashes match content.
TestReservePrefixCache = machine_for(Policy.RESERVE, prefix_cache=True).TestCase
TestPreemptPrefixCache = machine_for(Policy.PREEMPT, prefix_cache=True).TestCase
TestPreemptUnderPressurePrefixCache = machine_for(
    Policy.PREEMPT, ends_early=False, prefix_cache=True
).TestCase
TestFreeSlotSafetyPrefixCache = machine_for(Policy.FREE_SLOT, prefix_cache=True).TestCase

# Cancelling can only break a deadlock, so the search leaves it out.
FreeSlotClaimingNoDeadlock = machine_for(
    Policy.FREE_SLOT, FreeSlot.claims | {Claim.NO_DEADLOCK}, ends_early=False
)


def test_the_search_finds_the_free_slot_deadlock() -> None:
    # The same claims that hold for reserve and preempt; only the policy differs.
    # Derandomized with a generous budget: hypothesis stops at the first deadlock.
    search = settings(
        max_examples=400,
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        database=None,
        report_multiple_bugs=False,
        # Finding is the point; shrinking a 40-rule story costs minutes on a loaded
        # machine. `just prop-long` (HYPOTHESIS_PROFILE=long) shrinks it.
        phases=[Phase.explicit, Phase.generate]
        if settings.get_current_profile_name() != "long"
        else list(Phase),
        suppress_health_check=[HealthCheck.too_slow],
    )
    with pytest.raises(AssertionError, match="no-deadlock violated: deadlock after step"):
        run_state_machine_as_test(FreeSlotClaimingNoDeadlock, settings=search)
