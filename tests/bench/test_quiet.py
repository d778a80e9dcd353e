"""The quiet-machine guard's arithmetic (triollm.bench.quiet), on made-up /proc data."""

from __future__ import annotations

import pytest

from triollm.bench import quiet
from triollm.bench.quiet import Guard, Proc, is_busy, others_cores, parse_stat, tree

TICK = quiet._TICKS


def test_parse_stat_counts_fields_from_the_last_parenthesis() -> None:
    fields = ["S", "7"] + ["0"] * 9 + [str(3 * TICK), str(TICK)] + ["0"] * 10
    line = "42 (evil) name (x)) " + " ".join(fields)
    assert parse_stat(line) == (42, "evil) name (x)", 7, 4.0)


def _snap(*procs: tuple[int, int, str, float]) -> dict[int, Proc]:
    return {pid: Proc(pid, ppid, comm, cpu) for pid, ppid, comm, cpu in procs}


def test_tree_is_the_root_and_all_its_descendants() -> None:
    snap = _snap((1, 0, "init", 0), (10, 1, "py", 0), (11, 10, "llama", 0),
                 (12, 11, "omp", 0), (20, 1, "other", 0))  # fmt: skip
    assert tree(snap, 10) == {10, 11, 12}


def test_others_cores_leave_out_our_tree_and_count_newcomers_whole() -> None:
    before = _snap((10, 1, "py", 5.0), (11, 10, "llama", 1.0), (20, 1, "job", 100.0))
    after = _snap(
        (10, 1, "py", 5.5),
        (11, 10, "llama", 9.0),  # ours: 8 s of CPU, not counted
        (20, 1, "job", 102.0),  # 2 s over 4 s: 0.5 cores
        (30, 1, "new", 1.0),  # started in the window: all of its 1 s
        (40, 1, "sleeper", 0.0),
        (50, 2, "kworker/u8:1", 3.0),  # a kernel thread: not counted
    )
    cores, top = others_cores(before, after, 4.0, ours={10, 11})
    assert cores == pytest.approx(0.75)
    assert [(c, p) for c, p, _ in top] == [("job", 20), ("new", 30)]


def test_a_reused_pid_counts_as_a_new_process() -> None:
    before = _snap((20, 1, "old", 50.0))
    after = _snap((20, 1, "fresh", 1.0))
    assert others_cores(before, after, 2.0, ours=set())[0] == pytest.approx(0.5)


def test_the_guard_waits_then_marks_the_round_busy_after_the_bounded_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    g = Guard(threshold=0.25, window=0.0, max_wait=0.05, log=seen.append)
    monkeypatch.setattr(g, "measure", lambda window=None: (1.0, [("spin", 99, 1.0)]))
    rec = g.before_round()
    assert rec["busy_before"] and rec["others_cores_before"] == 1.0
    assert rec["top_before"] == "spin[99] 1.00"
    assert seen and "machine busy" in seen[0]
    rec |= g.after_round()
    assert is_busy(rec)


def test_the_guard_passes_a_quiet_machine_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    g = Guard(threshold=0.25, window=0.0, max_wait=60)
    answers = iter([(0.9, []), (0.02, [])])  # busy once, then quiet
    monkeypatch.setattr(g, "measure", lambda window=None: next(answers))
    rec = g.before_round()
    assert not rec["busy_before"] and rec["others_cores_before"] == 0.02


def test_a_job_during_the_round_marks_it_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    g = Guard(threshold=0.25, window=0.0, root=10)
    monkeypatch.setattr(g, "measure", lambda window=None: (0.0, []))
    snaps = iter([_snap((10, 1, "py", 0.0), (20, 1, "job", 0.0)),
                  _snap((10, 1, "py", 9.0), (20, 1, "job", 50.0))])  # fmt: skip
    monkeypatch.setattr(quiet, "snapshot", lambda proc=quiet.PROC: next(snaps))
    rec = g.before_round() | g.after_round()
    assert rec["busy_during"] and is_busy(rec)


def test_the_real_proc_is_readable_and_we_are_in_our_own_tree() -> None:
    import os

    snap = quiet.snapshot()
    if not snap:
        pytest.skip("no /proc on this system")
    assert os.getpid() in tree(snap, os.getpid())
    assert snap[os.getpid()].cpu_s >= 0
