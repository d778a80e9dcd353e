"""The arithmetic of an alternating side-by-side run: per-round ratios, medians, verdicts.

A run measures both systems in rounds (A B, A B, A B: each round runs the peer and
then triollm on the same workload), and the guard (``quiet.py``) marks a round busy
when other processes used the machine. One figure per system is then not the claim;
the claim is the set of per-round ratios:

- a ratio is triollm / the peer within one round (the two ran minutes apart, under
  the same conditions), never a ratio of figures taken in different rounds;
- the median ratio and the medians of each side come from the quiet rounds only
  (busy rounds are shown, marked, and count for nothing);
- the verdict names the faster system only when every quiet round agrees on which
  side of 1.0 the ratio falls and there are at least ``MIN_ROUNDS`` of them;
  otherwise it is "not established".

Pure: plain numbers in, plain data out (``tests/bench/test_rounds.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MIN_ROUNDS = 3


@dataclass(frozen=True)
class Round:
    round: int
    ours: float
    peer: float
    busy: bool

    @property
    def ratio(self) -> float | None:
        return self.ours / self.peer if self.peer else None


@dataclass(frozen=True)
class Summary:
    """One row and metric of a comparison, over the rounds."""

    rounds: tuple[Round, ...]  # every round both sides measured, in round order
    higher_is_better: bool
    ours_name: str = "triollm"
    peer_name: str = "llama.cpp"

    @property
    def quiet(self) -> tuple[Round, ...]:
        return tuple(r for r in self.rounds if not r.busy and r.ratio is not None)

    def _over(self) -> tuple[Round, ...]:
        # medians from the quiet rounds; if none was quiet, from all (shown as busy)
        return self.quiet or tuple(r for r in self.rounds if r.ratio is not None)

    @property
    def ours(self) -> float | None:
        over = self._over()
        return statistics.median(r.ours for r in over) if over else None

    @property
    def peer(self) -> float | None:
        over = self._over()
        return statistics.median(r.peer for r in over) if over else None

    @property
    def ratio(self) -> float | None:
        """The median of the per-round ratios (not the ratio of the medians)."""
        ratios = [r.ratio for r in self._over() if r.ratio is not None]
        return statistics.median(ratios) if ratios else None

    @property
    def spread(self) -> tuple[float, float] | None:
        ratios = [r.ratio for r in self.quiet if r.ratio is not None]
        return (min(ratios), max(ratios)) if ratios else None

    @property
    def verdict(self) -> str:
        quiet = self.quiet
        if not quiet:
            return "busy machine: no quiet round"
        ratios = [r.ratio for r in quiet if r.ratio is not None]
        above, below = all(x > 1.0 for x in ratios), all(x < 1.0 for x in ratios)
        if not (above or below):
            return "not established: the rounds disagree"
        if len(quiet) < MIN_ROUNDS:
            return f"not established: {len(quiet)} quiet round(s) of the {MIN_ROUNDS} needed"
        # ratio = ours / peer: above 1.0 is ours faster for a throughput, slower for a latency
        ours_better = above == self.higher_is_better
        return f"{self.ours_name if ours_better else self.peer_name} faster"

    def per_round(self) -> str:
        """``0.66, 0.71, 0.69 (busy)``: every round's ratio, busy ones marked."""
        return ", ".join(
            ("—" if r.ratio is None else f"{r.ratio:.2f}") + (" (busy)" if r.busy else "")
            for r in self.rounds
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "ours": self.ours,
            "peer": self.peer,
            "ratio_median": self.ratio,
            "ratio_spread": self.spread,
            "per_round": [
                {"round": r.round, "ours": r.ours, "peer": r.peer, "ratio": r.ratio, "busy": r.busy}
                for r in self.rounds
            ],
            "quiet_rounds": len(self.quiet),
            "verdict": self.verdict,
        }


def pair_rounds(
    ours: Mapping[int, float], peer: Mapping[int, float], busy: Iterable[int]
) -> tuple[Round, ...]:
    """The rounds both sides measured, each with its busy mark."""
    marked = set(busy)
    return tuple(
        Round(r, float(ours[r]), float(peer[r]), r in marked) for r in sorted(set(ours) & set(peer))
    )


def summarize(
    ours: Mapping[int, float],
    peer: Mapping[int, float],
    busy: Iterable[int] = (),
    *,
    higher_is_better: bool = True,
) -> Summary:
    return Summary(pair_rounds(ours, peer, busy), higher_is_better)


def fmt(v: float | None) -> str:
    if v is None:
        return "—"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if abs(v) >= 1 else f"{v:.2f}"


def table_row(label: str, s: Summary) -> str:
    """One markdown row: what, triollm, peer, median ratio, spread, per-round, verdict."""
    ratio = "—" if s.ratio is None else f"{s.ratio:.2f}x"
    spread = "—" if s.spread is None else f"{s.spread[0]:.2f}-{s.spread[1]:.2f}"
    return (
        f"| {label} | {fmt(s.ours)} | {fmt(s.peer)} | {ratio} | {spread} "
        f"| {s.per_round()} | {s.verdict} |"
    )


TABLE_HEAD = (
    "| what | triollm | llama.cpp | ratio (median) | spread (quiet rounds) "
    "| per round | verdict |\n| --- | ---: | ---: | ---: | ---: | --- | --- |"
)
