"""`triollm trace`: the tracer's lines (plain, sync), and the transcript in
docs/architecture.md is what the command prints today, but for the times."""

from __future__ import annotations

import argparse
import re
import shlex
from itertools import count
from pathlib import Path

import trio

from triollm.plan import SampledToken, StepResult
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.spec import SequenceSpec
from triollm.trace import Tracer

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _run(s: Scheduler, tracer: Tracer, steps: int) -> None:
    for _ in range(steps):
        s.admit_waiting()
        plan = s.plan_step()
        if plan.is_empty:
            return
        sampled = tuple(SampledToken(c.seq_id, 7) for c in plan.chunks if c.sample)
        result = StepResult(plan.step, sampled, plan.n_rows)
        s.commit(result)
        tracer.record(plan, result)


def _tracer(s: Scheduler) -> Tracer:
    ticks = count()
    return Tracer(s, clock=lambda: float(next(ticks)), token_text=lambda i: f"<{i}>")


def test_a_traced_request_shows_its_rows_its_blocks_and_its_token_each_step() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, slots=2, chunk_tokens=4))
    s.add(SequenceSpec([1, 2, 3, 4, 5, 6], max_tokens=3))
    tracer = _tracer(s)
    _run(s, tracer, 10)
    texts = [line.text.split(" | ", 1)[1] for line in tracer.lines]
    assert texts == [
        "A prefill 0-3, takes [0 1 2]",  # reserve: prompt + answer at admission
        "A prefill 4-5 -> '<7>'",  # the last chunk samples the first token
        "A decode 6 -> '<7>'",
        "A decode 7 -> '<7>', done, frees [0 1 2]",
    ]
    assert [line.at for line in tracer.lines] == sorted(line.at for line in tracer.lines)


def test_a_neighbour_that_finds_the_opening_cached_shares_its_block() -> None:
    cfg = SchedulerConfig(num_blocks=8, block_size=4, slots=2, chunk_tokens=8, prefix_cache=True)
    s = Scheduler(cfg)
    s.add(SequenceSpec([1, 2, 3, 4, 5], max_tokens=4))
    tracer = _tracer(s)
    _run(s, tracer, 1)  # A's prompt: its first block is full, so it is published
    s.add(SequenceSpec([1, 2, 3, 4, 9, 9], max_tokens=2))
    _run(s, tracer, 10)
    b_first = next(line.text for line in tracer.lines if "B prefill" in line.text)
    assert "B prefill 4-5" in b_first  # the cached opening is not computed again
    assert "shares [0]" in b_first


# The page's transcript: every line but the times is what the command prints now.
TIME = re.compile(r"^\s*\d+\.\d{4}  ")


def _page_transcript() -> tuple[str, list[str]]:
    section = DOC.read_text(encoding="utf-8").split("## One request, traced", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    first, *lines = block.rstrip("\n").splitlines()
    assert first.startswith("$ triollm trace")
    return first[2:], lines


def _shape(lines: list[str]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(the header, the step lines in order, each request's own lines in order), times
    cut off: events of two requests at one instant may arrive in either order."""
    head = [ln for ln in lines if not TIME.match(ln)]
    timed = [TIME.sub("", ln) for ln in lines if TIME.match(ln)]
    steps = [ln for ln in timed if ln.startswith("step")]
    own: dict[str, list[str]] = {}
    for ln in timed:
        if not ln.startswith("step"):
            own.setdefault(ln.split()[0], []).append(ln)
    return head, steps, own


def test_the_transcript_in_architecture_md_is_what_triollm_trace_prints() -> None:
    from triollm.mechanisms import trace

    command, quoted = _page_transcript()
    parser = argparse.ArgumentParser()
    trace.configure(parser)
    args = parser.parse_args(shlex.split(command)[2:])
    printed = trio.run(trace.main, args, lambda line: None)
    assert _shape(quoted) == _shape(printed)
    # A's events arrive in the order of its steps, each after the step that made it.
    at = {TIME.sub("", ln): float(ln.split()[0]) for ln in printed if TIME.match(ln)}
    a_steps = [t for ln, t in at.items() if ln.startswith("step") and "A " in ln]
    a_events = [t for ln, t in at.items() if ln.startswith("A  SSE") and "[DONE]" not in ln]
    assert len(a_steps) == len(a_events)
    assert all(s <= e for s, e in zip(a_steps, a_events, strict=True))
