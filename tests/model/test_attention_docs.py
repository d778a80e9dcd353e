"""docs/engine.md's online-softmax example runs, and prints what the page says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"
EXAMPLE = re.compile(r"```python\n(.*?)```\n\nwhich prints\n\n```text\n(.*?)```", re.S)


def test_the_online_softmax_example_runs_and_prints_what_the_page_shows() -> None:
    (found,) = EXAMPLE.findall(DOC.read_text())
    code, printed = found
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})  # its own assert checks the direct softmax
    assert out.getvalue() == printed
