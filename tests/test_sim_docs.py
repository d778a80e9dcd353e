"""docs/simulation.md quotes `triollm simulate`'s output; it must still be true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triollm.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "simulation.md"


def test_the_tables_quoted_in_the_simulation_page_are_todays_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate"]) == 0
    out = capsys.readouterr().out
    quoted = re.findall(r"```text\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(quoted) == 3
    for block in quoted:
        assert block.strip() in out, block


def test_the_page_screenshot_the_docs_show_exists() -> None:
    assert (DOC.parent / "img" / "sim-page.png").stat().st_size > 10_000
