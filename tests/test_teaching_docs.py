"""What the teaching pages say about the code is what the code does.

Each test here holds one sentence of the docs to the source it describes, so the page
and the code cannot drift apart silently (a learner reads the page first).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _section(page: str, heading: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_dispatch_is_described_as_the_count_output_py_compares_not_as_wouldblock() -> None:
    """streaming.md section 4 and book.md say the server compares the channel's count with
    its room (the channel keeps one place per choice for the end); output.py does that."""
    source = (ROOT / "src" / "triollm" / "output.py").read_text(encoding="utf-8")
    assert "current_buffer_used >= request.delta_room" in source
    assert "open_memory_channel[Event](delta_room + n)" in source
    deliver = source.split("def _deliver", 1)[1].split("\n    def ", 1)[0]
    assert "WouldBlock" not in deliver  # if dispatch ever catches it, rewrite section 4
    four = _section("streaming.md", "## 4. Dispatch never blocks")
    assert "current_buffer_used" in four and "delta_room + n" in four
    before_why = four.split("**Why a count and not `trio.WouldBlock`.**", 1)[0]
    assert "WouldBlock" not in before_why  # the mechanism itself never names it
    book = _section("book.md", "## 20.3.4 Backpressure and cancellation")
    assert "current_buffer_used >= delta_room" in book


_WORDS = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def test_the_loop_heading_counts_the_lines_of_the_loop() -> None:
    """scheduling.md's "The loop, in N lines": N is the loop's own line count."""
    page = (DOCS / "scheduling.md").read_text(encoding="utf-8")
    (word,) = re.findall(r"^## The loop, in (\w+) lines$", page, re.M)
    block = page.split(f"## The loop, in {word} lines", 1)[1].split("```python\n", 1)[1]
    lines = block.split("```", 1)[0].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("while "))
    body = 0
    while start + 1 + body < len(lines) and lines[start + 1 + body].startswith("    "):
        body += 1
    loop = lines[start : start + 1 + body]
    assert len(loop) == _WORDS[word], f"the heading says {word}; the loop has {len(loop)} lines"


def _defs(path: Path) -> dict[str, int]:
    """Top-level functions and classes, and methods as Class.name -> their length."""
    import ast

    found: dict[str, int] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        length = (sub.end_lineno or sub.lineno) - sub.lineno + 1
                        found[f"{node.name}.{sub.name}"] = length
    return found


def test_the_core_page_names_real_files_and_functions_at_about_their_size() -> None:
    """docs/core.md: every file and function it lists exists, at about the length it says."""
    page = (DOCS / "core.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \d+ \| `src/triollm/([^`]+)` \| (\d+) \| (.+?) \| (\d+) \|", page, re.M)
    assert len(rows) >= 12
    for path, stated, functions, _ in rows:
        file = ROOT / "src" / "triollm" / path
        lines = len(file.read_text(encoding="utf-8").splitlines())
        assert abs(lines - int(stated)) <= max(40, lines // 5), f"{path}: {stated} vs {lines}"
        defs = _defs(file)
        for name, length in re.findall(r"`([\w.]+)` \((\d+)\)", functions):
            assert name in defs, f"{path} has no {name}"
            real = defs[name]
            assert abs(real - int(length)) <= max(10, real // 4), f"{name}: {length} vs {real}"


def test_performance_teaches_and_results_records_written_by_the_tool() -> None:
    """performance.md is the teaching page; the side-by-side section the benchmark tool
    writes lives in results.md, and neither sends the reader to an issue they cannot see."""
    teach = (DOCS / "performance.md").read_text(encoding="utf-8")
    results = (DOCS / "results.md").read_text(encoding="utf-8")
    report = (ROOT / "tools" / "bench_peers_report.py").read_text(encoding="utf-8")
    assert 'DOC = REPO / "docs" / "results.md"' in report
    assert "<!-- bench-peers:begin" in results and "<!-- bench-peers:end -->" in results
    assert "bench-peers:begin" not in teach
    for text in (teach, results):
        assert not re.search(r"\bthe issue\b|\bissue \d+", text, re.I)
    assert "## Why batching pays" in teach and "## How we measure and why" in teach


def test_every_break_it_row_is_an_exercise_and_every_exercise_a_row() -> None:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("break_it", ROOT / "tools" / "break_it.py")
    assert spec is not None and spec.loader is not None
    break_it = importlib.util.module_from_spec(spec)
    sys.modules["break_it"] = break_it
    spec.loader.exec_module(break_it)
    page = (DOCS / "exercises.md").read_text(encoding="utf-8")
    tried = set(re.findall(r"--try ([\w-]+)", page))
    assert tried == {m.key for m in break_it.MUTATIONS} == set(break_it.PROOFS)
    steps = re.findall(r"^\d\. \*\*", page.split("## Build it yourself", 1)[1], re.M)
    assert len(steps) == 8
