"""The quiet-machine guard: how much CPU *other* processes use, before and during a round.

A comparison taken while something else runs is not a comparison of the two systems:
llama.cpp spins its OpenMP threads and falls 2-4x when a core is taken, triollm's
workers sleep and fall less, so any background job inflates triollm's ratio
(issue 21, cause 2). The 1-minute load average cannot tell the harness's own two
threads from a neighbour's, and it lags by a minute; per-process CPU time can.

:func:`snapshot` reads every process's CPU time (user + system, all its threads)
from ``/proc``; :func:`others_cores` turns two snapshots into the cores used by
processes outside the harness's own process tree. A process frozen with SIGSTOP
uses none. :class:`Guard` waits before a round until the others use less than a
threshold, up to a bounded time, and says whether the round must be marked busy;
it measures the others again over the whole round (a job that started mid-round
marks it too).

Linux only (``/proc``); elsewhere the guard reports ``None`` and marks nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    cpu_s: float  # user + system seconds since the process started, all threads


def parse_stat(text: str) -> tuple[int, str, int, float]:
    """(pid, comm, ppid, cpu seconds) from one ``/proc/PID/stat`` line.

    Trap: the command name is in parentheses and may itself hold spaces and
    parentheses, so the fields are counted from the *last* ``)``.
    """
    head, _, rest = text.rpartition(")")
    pid_s, _, comm = head.partition(" (")
    fields = rest.split()
    # fields[0] is the state (field 3 of proc(5)); ppid is field 4, utime 14, stime 15
    ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
    return int(pid_s), comm, ppid, (utime + stime) / _TICKS


def snapshot(proc: Path = PROC) -> dict[int, Proc]:
    """Every visible process now; one that exits while being read is skipped."""
    out: dict[int, Proc] = {}
    try:
        entries = list(proc.iterdir())
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            pid, comm, ppid, cpu = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        out[pid] = Proc(pid, ppid, comm, cpu)
    return out


def tree(snap: dict[int, Proc], root: int) -> set[int]:
    """``root`` and all its descendants in ``snap``."""
    children: dict[int, list[int]] = {}
    for p in snap.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


KTHREADD = 2  # the parent of every kernel thread on Linux


def others_cores(
    before: dict[int, Proc], after: dict[int, Proc], seconds: float, ours: set[int]
) -> tuple[float, list[tuple[str, int, float]]]:
    """Cores used between the snapshots by processes not in ``ours``, and the top users
    as (command, pid, cores). A process seen in both snapshots counts its difference;
    one that started in between counts all its time (it all fell in the window).

    Kernel threads are left out: on a quiet machine their work (page faults, writeback)
    is mostly the benchmark's own, and it is the same for both systems."""
    if seconds <= 0:
        return 0.0, []
    users = []
    for pid, p in after.items():
        if pid in ours or pid == KTHREADD or p.ppid == KTHREADD:
            continue
        b = before.get(pid)
        used = p.cpu_s - b.cpu_s if b is not None and b.comm == p.comm else p.cpu_s
        if used > 0:
            users.append((p.comm, pid, used / seconds))
    users.sort(key=lambda u: -u[2])
    return sum(u[2] for u in users), users[:5]


@dataclass
class Guard:
    """Wait for a quiet machine before a round; say whether the round was busy.

    ``threshold``: cores other processes may use (default 0.15 of a core: the
    system's own daemons use a few hundredths; a competing job one whole core).
    ``window``: seconds each check measures over. ``max_wait``: seconds to wait
    for quiet before the round runs anyway, marked busy.
    """

    threshold: float = 0.15
    window: float = 3.0
    max_wait: float = 120.0
    log: Callable[[str], None] = print
    root: int = field(default_factory=os.getpid)
    _start: tuple[float, dict[int, Proc]] | None = None

    def measure(self, window: float | None = None) -> tuple[float, list[tuple[str, int, float]]]:
        """Cores the others use over ``window`` seconds from now."""
        before, t = snapshot(), time.monotonic()
        time.sleep(self.window if window is None else window)
        after = snapshot()
        ours = tree(before, self.root) | tree(after, self.root)
        return others_cores(before, after, time.monotonic() - t, ours)

    def before_round(self) -> dict[str, Any]:
        """Wait until the others use less than the threshold (at most ``max_wait`` s);
        then start measuring the round itself. The returned dict goes in the JSON."""
        t0 = time.monotonic()
        while True:
            cores, top = self.measure()
            waited = time.monotonic() - t0
            if cores < self.threshold or waited >= self.max_wait:
                break
            self.log(
                f"machine busy: other processes use {cores:.2f} cores "
                f"(threshold {self.threshold}): {_fmt_top(top)}; waited {waited:.0f} s "
                f"of {self.max_wait:.0f}"
            )
        self._start = (time.monotonic(), snapshot())
        return {
            "others_cores_before": round(cores, 3),
            "top_before": _fmt_top(top),
            "waited_s": round(waited, 1),
            "busy_before": cores >= self.threshold,
        }

    def after_round(self) -> dict[str, Any]:
        """The others' cores averaged over the round since :meth:`before_round`."""
        if self._start is None:
            raise RuntimeError("after_round without before_round")
        t, before = self._start
        after = snapshot()
        ours = tree(before, self.root) | tree(after, self.root)
        cores, top = others_cores(before, after, time.monotonic() - t, ours)
        self._start = None
        return {
            "others_cores_during": round(cores, 3),
            "top_during": _fmt_top(top),
            "busy_during": cores >= self.threshold,
        }


def _fmt_top(top: list[tuple[str, int, float]]) -> str:
    return ", ".join(f"{comm}[{pid}] {cores:.2f}" for comm, pid, cores in top if cores >= 0.01)


def is_busy(guard_record: dict[str, Any]) -> bool:
    """A round is busy if the machine was busy before it (after the bounded wait) or
    during it."""
    return bool(guard_record.get("busy_before") or guard_record.get("busy_during"))
