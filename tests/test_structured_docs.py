"""The samples in docs/constrained-decoding.md and docs/tool-calls.md run, and every
file and test those pages name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("constrained-decoding.md", "tool-calls.md")
SAMPLES = [
    (page, source)
    for page in PAGES
    for source in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)
]


def test_each_page_has_a_sample() -> None:
    assert {page for page, _ in SAMPLES} == set(PAGES)


@pytest.mark.parametrize(("page", "source"), SAMPLES, ids=[p for p, _ in SAMPLES])
def test_the_python_sample_runs(page: str, source: str) -> None:
    exec(compile(source, page, "exec"), {"__name__": "docs_sample"})


@pytest.mark.parametrize("page", PAGES)
def test_every_file_and_test_the_page_names_exists(page: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    for path in set(re.findall(r"`((?:src|tests|bench|tools)/[\w/.-]+\.py)`", text)):
        assert (ROOT / path).is_file(), f"{page} names {path}, which does not exist"
    files = list((ROOT / "tests").rglob("test_*.py"))
    sources = [p.read_text() for p in files]
    for name in set(re.findall(r"\b(test_[a-z0-9_]+)\b", text)) - {p.stem for p in files}:
        assert any(f"def {name}(" in s for s in sources), f"{page} cites {name}: no such test"
