"""`triollm check-policy`: it proves what a policy claims, and it has teeth.

The counter-checks: the harness must find the free-slot deadlock (when the
no-deadlock claim is added), the leak of a deliberately broken policy, and the
starvation of shortest-prompt-first without its aging bound (that one is also
the trace docs/policies.md shows: tests/test_policies_docs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triollm.cli import main
from triollm.policies import Policy
from triollm.sim.runner import simulate
from triollm.sim.scenario import load_scenario


def check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["check-policy", *argv, "--quiet"])
    return status, capsys.readouterr().out


def test_an_object_that_is_not_a_policy_is_refused_naming_what_it_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "not_quite.py"
    f.write_text(
        "class Lifo:\n    name = 'lifo'\n    def waiting_order(self, w):\n        return w\n"
    )
    assert main(["check-policy", f"{f}:Lifo"]) == 2
    err = capsys.readouterr().err
    assert "is not a scheduling policy: it lacks description, claims, grows" in err
    assert "admission_blocks()" in err and "waiting_order()" not in err


def test_the_claims_a_policy_does_not_make_are_reported_as_not_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out = check(["free-slot", "--examples", "25"], capsys)
    assert status == 0
    assert "checking 3 claim(s):" in out
    assert "not checked (the policy does not claim them): no-deadlock, liveness," in out
    assert "held: all 3 claim(s), over" in out


def test_it_finds_the_free_slot_deadlock_and_writes_a_replay_that_deadlocks_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replay = tmp_path / "deadlock.json"
    # Unshrunk, so the story (and whether it replays) does not depend on the load.
    argv = ["free-slot", "--claim", "no-deadlock", "--no-shrink"]
    status, out = check([*argv, "--replay", str(replay)], capsys)
    assert status == 1
    assert "an idle scheduler admits its queue (added by --claim)" in out
    assert "no-deadlock violated: deadlock after step" in out
    assert "NOTHING CAN MOVE" in out
    assert f"wrote {replay}: it replays this counter-example step for step" in out
    run = simulate(load_scenario(replay), Policy.FREE_SLOT)
    assert run.deadlock is not None
    assert f"?step={run.deadlock.t}" in out  # the page opens at the step that stuck


def test_it_catches_the_policy_that_leaks_a_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replay = tmp_path / "leak.json"
    status, out = check(
        ["triollm.policy_examples.leaky:SpareBlock", "--steps", "20", "--replay", str(replay)],
        capsys,
    )
    assert status == 1
    assert "blocks-conserved violated: seq 0 holds" in out
    assert "is leaked until it ends" in out
    assert json.loads(replay.read_text())["requests"]


def test_it_finds_shortest_prompt_first_passing_a_long_prompt_past_its_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found within seconds; shrinking is cut short here (docs/policies.md shows a full one).
    spec = "triollm.policy_examples.shortest_prompt_first:ShortestPromptFirst"
    status, out = check(
        [spec, "--steps", "25", "--shrink-time", "3", "--replay", str(tmp_path / "r.json")],
        capsys,
    )
    assert status == 1
    assert "bounded-overtaking violated: seq" in out
    assert "waiting longest, was passed 4 time(s) (the bound is 3)" in out


def test_a_policy_that_raises_is_reported_not_crashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "grumpy.py"
    f.write_text(
        "from triollm.policies import BasePolicy\n"
        "class Grumpy(BasePolicy):\n"
        "    def decode_order(self, decoding):\n"
        "        raise ZeroDivisionError('no rows today')\n"
    )
    status, out = check([f"{f}:Grumpy", "--steps", "20", "--shrink-time", "3"], capsys)
    assert status == 1
    assert "ZeroDivisionError: no rows today" in out


def test_bad_budgets_are_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-policy", "reserve", "--examples", "0"]) == 2
    assert "--examples must be >= 1" in capsys.readouterr().err
    assert main(["check-policy", "reserve", "--time-limit", "0"]) == 2
    assert "--time-limit must be > 0 seconds" in capsys.readouterr().err
