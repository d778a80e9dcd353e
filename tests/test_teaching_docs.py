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
