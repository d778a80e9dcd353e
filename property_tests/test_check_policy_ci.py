"""`triollm check-policy` in CI: the example policies at CI's example count, and the
built-in ones through the command (their deep search is test_scheduler_properties.py).

The seed is fresh each run, as the other property tests draw fresh examples, and a
failure names it: ``triollm check-policy SPEC --seed N`` replays the same search.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings

from triollm.cli import main

EXAMPLES = [
    "triollm.policy_examples.shortest_prompt_first:Aged",
    "triollm.policy_examples.priority:PriorityWithAging",
]
BUILTINS = ["reserve", "static", "free-slot", "preempt"]


def _check(spec: str, examples: int, capsys: pytest.CaptureFixture[str]) -> None:
    profile = settings.default
    seed = random.randrange(2**31)
    argv = [
        "check-policy",
        spec,
        "--examples",
        str(examples),
        "--steps",
        str(profile.stateful_step_count),
        "--seed",
        str(seed),
        "--time-limit",
        "3000",  # bounded by the example count; pytest-timeout guards a hang
        "--quiet",
    ]
    status = main(argv)
    out = capsys.readouterr().out
    assert status == 0, f"`triollm {' '.join(argv)}` found:\n{out}"
    assert "held: all" in out


@pytest.mark.parametrize("spec", EXAMPLES)
def test_the_example_policy_holds_every_claim_it_makes(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _check(spec, settings.default.max_examples, capsys)


@pytest.mark.parametrize("name", BUILTINS)
def test_check_policy_proves_the_builtin_policy(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _check(name, max(25, settings.default.max_examples // 4), capsys)
