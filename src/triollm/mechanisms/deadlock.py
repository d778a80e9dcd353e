"""Admission on a free slot alone deadlocks; reserving the answer cannot.

The book's Forma warns in a comment: admit whenever a slot is free and a moment comes
when every slot is taken, the pool is empty, and no running sequence can grow, so none
can finish and nothing is ever freed. Reserving the prompt *and* the answer at
admission (``ceil((prompt + max_tokens) / block)`` blocks, all or nothing) makes that
state unreachable: every admitted sequence already holds what it needs to finish.

This replays the seed's scenario (4 slots, 14 blocks of 4 positions, 7 requests)
through the real :class:`~triollm.scheduler.Scheduler` under both rules and prints the
pool step by step: free-slot admission locks up with every block held; reservation
admits fewer at a time and finishes them all.
"""

from __future__ import annotations

import argparse

from triollm.scheduler import Policy
from triollm.sim.runner import Run, simulate
from triollm.sim.scenario import seed_scenario


def _pool_line(run: Run, t: int) -> str:
    step = run.steps[t]
    held = "".join(b or "." for b in step.blocks)
    running = sorted({b for b in step.blocks if b})
    waiting = ",".join(step.waiting) or "-"
    return f"  step {t:>2}  pool [{held}]  running {''.join(running):<4} waiting {waiting}"


def story(policy: Policy) -> tuple[Run, list[str]]:
    """Run the seed's scenario under ``policy``; return the run and the lines to print."""
    run = simulate(seed_scenario(), policy)
    lines = [f"{policy.value}:"]
    previous = None
    for t in range(run.total_steps):
        line = _pool_line(run, t)
        if line.split("pool")[1] != previous:  # print only the steps where the pool changed
            lines.append(line)
            previous = line.split("pool")[1]
    if run.deadlock is not None:
        free = sum(b is None for b in run.steps[run.deadlock.t].blocks)
        lines.append(
            f"  DEADLOCK at step {run.deadlock.t}: {free} block(s) free, and nobody can finish:"
        )
        for name, held, needed in run.deadlock.holders:
            lines.append(f"    {name} holds {held} block(s) and needs {needed} more")
    else:
        finished = sum(o.done is not None for o in run.outcomes)
        lines.append(f"  all {finished} requests finished in {run.total_steps} steps")
    return run, lines


def configure(parser: argparse.ArgumentParser) -> None:
    """No options: the story is fixed so it prints the same lines every time."""


def run(args: argparse.Namespace) -> int:
    for policy in (Policy.FREE_SLOT, Policy.RESERVE):
        for line in story(policy)[1]:
            print(line)
        print()
    return 0
