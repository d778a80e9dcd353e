"""`triollm demo NAME`: every demonstration runs, ends by itself and shows its mechanism."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from triollm.cli import main
from triollm.mechanisms import DEMOS, lost_wakeup, slow_client


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_every_demo_runs_to_the_end_through_the_cli(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", name]) == 0
    assert capsys.readouterr().out.strip()


def test_the_slow_client_is_cut_at_step_three_and_the_fast_one_carries_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = trio.run(slow_client.main)
    assert lines == [
        "step 1: 2 requests left in the batch",
        "step 2: 2 requests left in the batch",
        "step 3: the slow client is 2 tokens behind; its request is cancelled",
        "step 3: 1 requests left in the batch",
        "step 4: 1 requests left in the batch",
    ]


def _run_lost_wakeup() -> tuple[dict[str, float], dict[str, float]]:
    readers, driver = trio.run(
        lost_wakeup.main,
        lambda line: None,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    return lost_wakeup.stalls(readers), lost_wakeup.stalls(driver)


def test_waiters_reading_the_capacity_channel_themselves_lose_a_wakeup() -> None:
    readers, _ = _run_lost_wakeup()
    assert readers["A"] == 4.0  # could enter at t=2 s, heard of it only at t=6 s
    assert math.isinf(readers["B"])  # the only signal after t=6 s went to A


def test_one_driver_admits_every_waiter_the_moment_it_fits() -> None:
    _, driver = _run_lost_wakeup()
    assert driver == {"A": 0.0, "B": 0.0}
