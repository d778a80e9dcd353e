"""docs/prefix-cache.md: its Python blocks run, and every test and name it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "prefix-cache.md"
SOURCES = [
    *ROOT.glob("src/**/*.py"),
    *ROOT.glob("tests/**/*.py"),
    *ROOT.glob("property_tests/*.py"),
]


def test_every_python_block_in_the_prefix_cache_page_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {})


def test_every_test_and_function_the_page_names_exists() -> None:
    text = DOC.read_text()
    code = "\n".join(p.read_text() for p in SOURCES)
    for name in set(re.findall(r"`(?:[A-Za-z_]+\.)?(test_[a-z0-9_]+|_?[a-z][a-z0-9_]+)`", text)):
        if name in {"reserve", "preempt", "free-slot", "on", "off", "cache_salt"}:
            continue
        assert re.search(rf"\b{re.escape(name)}\b", code), (
            f"the page names {name}, which is nowhere"
        )
    for path in re.findall(r"`((?:src|tests|property_tests|bench)/[\w/.]+)`", text):
        assert (ROOT / path).exists(), path
