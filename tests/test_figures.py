"""The teaching pictures say what they mean: tools/figures.py's labels (needs matplotlib,
the `plots` and `fixtures` extras; skipped without it)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _figures():  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("figures", ROOT / "tools" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = module
    spec.loader.exec_module(module)
    return module


def test_every_block_table_cell_names_its_positions_and_its_pool_block() -> None:
    """block-table.png once labelled every cell "→ {b}" (an escaped brace): each cell
    must read "lo-hi → block", and the blocks must be the scheduler's."""
    figures = _figures()
    fig = figures.draw_block_table(24)
    labels = [t.get_text() for t in fig.axes[0].texts if "→" in t.get_text()]
    assert len(labels) >= 8
    for label in labels:
        assert re.fullmatch(r"\d+-\d+\n→ \d+", label), label
    blocks = {int(label.rsplit(" ", 1)[1]) for label in labels}
    assert blocks <= set(range(14)) and len(blocks) == len(labels)  # one owner per block
