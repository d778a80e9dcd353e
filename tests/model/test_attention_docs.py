"""docs/engine.md's attention examples run, and print what the page says they print.

Two: the online softmax over tiles, and the merge of a split context's segments.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"
EXAMPLE = re.compile(r"```python\n(.*?)```\n\nwhich prints\n\n```text\n(.*?)```", re.S)


def test_the_attention_examples_run_and_print_what_the_page_shows() -> None:
    found = EXAMPLE.findall(DOC.read_text())
    assert len(found) == 2  # the online softmax, the segments' merge
    for code, printed in found:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(DOC), "exec"), {})  # its own assert checks the direct softmax
        assert out.getvalue() == printed
