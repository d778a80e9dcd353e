"""Every Python sample in docs/serving.md, streaming.md and cancellation.md runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ("serving.md", "streaming.md", "cancellation.md")
SAMPLES = [
    (page, source)
    for page in PAGES
    for source in re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
]


def test_the_pages_exist_and_have_a_sample():
    assert all((DOCS / page).exists() for page in PAGES)
    assert SAMPLES


@pytest.mark.parametrize(("page", "source"), SAMPLES, ids=[p for p, _ in SAMPLES])
def test_python_sample_runs(page: str, source: str) -> None:
    exec(compile(source, str(DOCS / page), "exec"), {"__name__": "docs_sample"})


def test_every_test_the_pages_cite_exists():
    tests = Path(__file__).resolve().parents[1]
    files = list(tests.rglob("test_*.py"))
    stems = {p.stem for p in files}
    for page in PAGES:
        text = (DOCS / page).read_text()
        for name in set(re.findall(r"\b(test_[a-z0-9_]+)\b", text)) - stems:
            found = any(f"def {name}(" in p.read_text() for p in files)
            assert found, f"{page} cites {name}, which no test defines"
