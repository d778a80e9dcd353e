"""`triollm demo NAME`: every demonstration runs, ends by itself and shows its mechanism."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from triollm.cli import main
from triollm.mechanisms import (
    DEMOS,
    chunked_prefill,
    deadlock,
    disconnect,
    lost_wakeup,
    overload,
    slow_client,
)
from triollm.scheduler import Policy

# These start a real server or build a real model; their own tests below run them once.
LIVE = {"disconnect", "overload", "batching"}


@pytest.mark.parametrize("name", sorted(set(DEMOS) - LIVE))
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


def test_free_slot_admission_deadlocks_with_every_block_held_and_reserve_finishes_all() -> None:
    free_slot, lines = deadlock.story(Policy.FREE_SLOT)
    assert free_slot.deadlock is not None
    assert all(b is not None for b in free_slot.steps[free_slot.deadlock.t].blocks)
    holders = len(free_slot.deadlock.holders)
    assert lines[-1 - holders] == (
        f"  DEADLOCK at step {free_slot.deadlock.t}: 0 block(s) free, and nobody can finish:"
    )
    reserve, lines = deadlock.story(Policy.RESERVE)
    assert reserve.deadlock is None
    assert all(o.done is not None for o in reserve.outcomes)
    assert lines[-1] == f"  all 7 requests finished in {reserve.total_steps} steps"


def test_chunks_bound_the_decode_gap_by_one_chunk_and_not_the_whole_prompt() -> None:
    chunked = chunked_prefill.replay(128)
    whole = chunked_prefill.replay(chunked_prefill.LONG_PROMPT)
    one_chunk_step_ms = chunked_prefill.STEP_MS + chunked_prefill.ROW_MS * (
        128 + chunked_prefill.STREAMS
    )
    assert chunked.longest_gap_ms <= one_chunk_step_ms
    assert whole.longest_gap_ms > 10 * chunked.longest_gap_ms
    # the long prompt pays only the extra steps' fixed cost for the chunking
    assert (
        whole.long_prompt_ttft_ms <= chunked.long_prompt_ttft_ms < 1.2 * whole.long_prompt_ttft_ms
    )


async def test_a_client_leaving_frees_its_blocks_at_once_queued_in_prefill_and_in_decode() -> None:
    lines = await disconnect.main(lambda line: None)
    total = lines[0].split("blocks free ")[1].split(",")[0].split("/")[1]
    by_moment = {line.split(":")[0].strip(): line for line in lines}
    assert "waiting 0" in by_moment["B hung up while queued"]
    for moment in ("A hung up in prefill", "C hung up in decode"):
        # before any further step ran (the loop is held): every block is back
        assert f"blocks free {total}/{total}, running 0" in by_moment[moment]
    assert lines[-1].endswith(": 3")  # three client_closed endings, none an error


async def test_a_burst_past_the_queue_is_429_at_once_and_the_wait_budget_429_not_499() -> None:
    lines = await overload.main(lambda line: None)
    refusals = {line.split(":")[0].strip(): line for line in lines if ": 429" in line}
    for name in "DEF":
        assert "429 queue_full, Retry-After: 2" in refusals[name]
    for name in "BC":
        assert "429 queue_timeout, Retry-After: 2" in refusals[name]
    assert "  (all three answered at once: nobody waited)" in lines
    assert lines[-2] == "A, released, completes: 200, finish_reason length"


def test_batching_times_each_batch_size_beside_its_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Figures are machine-dependent (a benchmark's business); the shape of the report is not.
    args = ["demo", "batching", "--layers", "2", "--batches", "1,4", "--steps", "2"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("SmolLM2-135M's shape, 2 layers, bf16: W = ")
    assert [line.split()[0] for line in lines[2:]] == ["1", "4"]


def test_the_one_driver_story_runs_the_servers_own_admission_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """demo lost-wakeup says its second story is the server's AdmissionQueue: it is
    (every admission there is a pass of the real driver over the real Scheduler)."""
    from triollm.admission import AdmissionQueue

    passes: list[tuple[int, ...]] = []
    real = AdmissionQueue.drive

    def counting(self: AdmissionQueue) -> tuple[int, ...]:
        passes.append(real(self))
        return passes[-1]

    monkeypatch.setattr(AdmissionQueue, "drive", counting)
    driver = trio.run(
        lost_wakeup.one_driver_reads,
        lambda line: None,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert sum(len(p) for p in passes) == 2  # A, then B: both through the real pass
    assert lost_wakeup.stalls(driver) == {"A": 0.0, "B": 0.0}


def test_a_step_measured_below_the_floor_is_flagged_not_shown_as_beating_memory() -> None:
    """demo batching once printed steps faster than its bandwidth floor, unflagged."""
    from triollm.mechanisms.batching import floor_note

    assert floor_note(0.012, 0.010, 1.0) == ""
    note = floor_note(0.008, 0.010, 9.5)
    assert "below the floor" in note and "load 9.5" in note
