"""docs/benchmarking.md: its sample runs, and what it names exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from triollm.bench import command

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarking.md"


def test_the_python_sample_runs() -> None:
    (source,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    exec(compile(source, str(DOC), "exec"), {"__name__": "docs_sample"})


def test_every_file_and_test_the_page_names_exists() -> None:
    text = DOC.read_text()
    for path in set(re.findall(r"`((?:src|tests|tools|bench)/[\w/.]+\.py)`", text)):
        assert (ROOT / path).exists(), path
    files = list((ROOT / "tests").rglob("test_*.py"))
    sources = "".join(p.read_text() for p in files)
    for name in set(re.findall(r"\b(test_[a-z0-9_]+)\b", text)) - {p.stem for p in files}:
        assert f"def {name}(" in sources, f"the page cites {name}, which no test defines"


def test_every_flag_the_page_names_is_a_flag_of_bench_serve() -> None:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {s for a in serve._actions for s in a.option_strings}
    named = set(re.findall(r"`(--[a-z-]+)", DOC.read_text()))
    assert named and named <= flags, named - flags
