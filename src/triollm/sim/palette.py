"""One colour scheme for every teaching picture: the simulator's page and tools/figures.py.

A request keeps its colour everywhere: the n-th request of a scenario is drawn in
``PALETTE[n % len(PALETTE)]`` on the page (``page.py`` hands the palette to the
page's script with the data) and in every PNG, so A is the same blue in the block
table, the step rows, the timeline and the stepper. The order is matplotlib's
``tab10``: ten hues that stay apart for most colour-blind readers and in print.
"""

from __future__ import annotations

from collections.abc import Sequence

PALETTE: tuple[str, ...] = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
FREE = "#e7e9ee"  # a free block, slot or row: the same pale grey on the page and in the PNGs


def colour_of(names: Sequence[str], name: str) -> str:
    """The colour of request ``name`` among a scenario's ``names`` (in file order)."""
    return PALETTE[list(names).index(name) % len(PALETTE)]
