"""The suite's stray-Cancelled guard (conftest.py) fails what pytest-trio would pass."""

from __future__ import annotations

from pathlib import Path

import pytest

GUARD = Path(__file__).resolve().parents[1] / "conftest.py"

CASES = """
import pytest
import trio


async def test_a_stray_cancelled():
    raise trio.Cancelled._create()
    assert False


async def test_a_stray_cancelled_inside_pytest_raises():
    with pytest.raises(ValueError):
        raise trio.Cancelled._create()
    assert False


async def test_a_scope_the_test_cancels_itself_is_fine():
    with trio.CancelScope() as scope:
        scope.cancel()
        await trio.sleep(1)
    assert scope.cancelled_caught


async def test_a_real_failure_still_fails():
    assert 1 == 2
"""


def run_cases(pytester: pytest.Pytester, *, guarded: bool) -> pytest.RunResult:
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    if guarded:
        pytester.makeconftest(GUARD.read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_cases=CASES)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider")


def test_without_the_guard_pytest_trio_passes_a_stray_cancelled(pytester: pytest.Pytester):
    # The hazard itself: if this starts failing, pytest-trio fixed it and the guard
    # may go.
    result = run_cases(pytester, guarded=False)
    result.assert_outcomes(passed=3, failed=1)


def test_the_guard_fails_a_stray_cancelled_and_nothing_else(pytester: pytest.Pytester):
    result = run_cases(pytester, guarded=True)
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(["*trio.Cancelled escaped the test*"])
