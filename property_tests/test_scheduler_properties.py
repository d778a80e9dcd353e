"""The Scheduler's claims, checked by hypothesis over arbitrary configs and events.

Each policy gets the same state machine (property_tests/scheduler_machine.py).
``reserve``, ``static`` and ``preempt`` must satisfy every claim, liveness included;
``free-slot`` must satisfy the safety claims, and a search must *find* its deadlock,
which shows the liveness claim can fail and so means something when it holds.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from triollm.scheduler import Policy

from .scheduler_machine import SchedulerMachine


class ReserveMachine(SchedulerMachine):
    POLICY = Policy.RESERVE


class StaticMachine(SchedulerMachine):
    POLICY = Policy.STATIC


class PreemptMachine(SchedulerMachine):
    POLICY = Policy.PREEMPT


class PreemptUnderPressureMachine(SchedulerMachine):
    POLICY = Policy.PREEMPT
    ENDS_EARLY = False  # no cancels: sequences live long and the pool runs dry more often


class FreeSlotSafetyMachine(SchedulerMachine):
    POLICY = Policy.FREE_SLOT
    CHECK_LIVENESS = False


class FreeSlotLivenessMachine(SchedulerMachine):
    POLICY = Policy.FREE_SLOT
    ENDS_EARLY = False  # cancelling can only break a deadlock, so the search leaves it out


TestReserve = ReserveMachine.TestCase
TestStatic = StaticMachine.TestCase
TestPreempt = PreemptMachine.TestCase
TestPreemptUnderPressure = PreemptUnderPressureMachine.TestCase
TestFreeSlotSafety = FreeSlotSafetyMachine.TestCase


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
    with pytest.raises(AssertionError, match="liveness violated: deadlock after step"):
        run_state_machine_as_test(FreeSlotLivenessMachine, settings=search)
