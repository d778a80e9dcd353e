"""docs/scheduling.md: its Python blocks run, and the messages it quotes are real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triollm.plan import SampledToken, StepResult
from triollm.scheduler import Infeasible, Policy, Scheduler, SchedulerConfig
from triollm.spec import SequenceSpec

DOC = Path(__file__).resolve().parents[1] / "docs" / "scheduling.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_every_python_block_in_the_scheduling_page_runs() -> None:
    blocks = python_blocks(DOC.read_text())
    assert blocks
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {})


def test_the_quoted_door_message_is_the_schedulers() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, context_tokens=2048))
    with pytest.raises(Infeasible) as err:
        s.add(SequenceSpec([1] * 2000, 100))
    assert f"    {err.value}\n" in DOC.read_text()


def test_the_quoted_deadlock_report_is_the_schedulers() -> None:
    cfg = SchedulerConfig(
        num_blocks=4, block_size=4, slots=2, step_rows=16, policy=Policy.FREE_SLOT
    )
    s = Scheduler(cfg)
    s.add(SequenceSpec([1] * 7, 8))
    s.add(SequenceSpec([1] * 7, 8))
    s.admit_waiting()
    while not (plan := s.plan_step()).is_empty:
        s.commit(StepResult(plan.step, tuple(SampledToken(c.seq_id, 1) for c in plan.chunks)))
    report = s.deadlock_report()
    assert report is not None
    quoted = (
        "deadlock after step 2: 0 block(s) free; "
        "seq 0 holds 2 block(s) [0, 1] after 8 positions and needs 1 more; "
    )
    assert quoted.rstrip("; ") in DOC.read_text()
    assert report.describe().startswith(quoted)
