"""Hypothesis profiles for the property tests.

``ci`` (the default) is bounded so the whole property suite runs in well under two
minutes on a small loaded machine. ``long`` (set ``HYPOTHESIS_PROFILE=long``, as
``just prop-long`` does) searches far more. Both draw fresh examples each run (and
replay saved failures first); the free-slot counter-check alone is derandomized,
so the search that must *find* a deadlock cannot flake.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Per state machine: max_examples runs of up to stateful_step_count rules each.
CI_EXAMPLES = 100
CI_STEPS = 40
LONG_EXAMPLES = 2000
LONG_STEPS = 100

settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    stateful_step_count=CI_STEPS,
    deadline=None,  # a loaded 2-core machine makes per-example timing meaningless
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=LONG_EXAMPLES,
    stateful_step_count=LONG_STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pyproject's 300 s per-test timeout guards CI against a hung test; a long
    # search is slow on purpose, so each of its tests gets an hour.
    if settings.get_current_profile_name() == "long":
        for item in items:
            item.add_marker(pytest.mark.timeout(3600))
