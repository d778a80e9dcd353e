"""Every ```console block in docs/ is run, and must still print what the page shows.

A block is a `$ triollm ...` command followed by its output. The command runs
in-process through the CLI (so no block may need a server or a network), and its
standard output must equal the lines the page quotes, exactly. A page whose quoted
output has gone stale fails here, not in a reader's terminal.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from triollm.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```console\n\$ (triollm [^\n]*)\n(.*?)```", re.S)
SAMPLES = [
    (page.name, command, output)
    for page in sorted(DOCS.glob("*.md"))
    for command, output in BLOCK.findall(page.read_text())
]


def test_the_docs_quote_commands_with_their_output() -> None:
    assert len(SAMPLES) >= 4


@pytest.mark.parametrize(
    ("page", "command", "output"), SAMPLES, ids=[f"{p}: {c}" for p, c, _ in SAMPLES]
)
def test_a_quoted_command_still_prints_what_the_page_shows(
    page: str,
    command: str,
    output: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(DOCS.parent)  # a path in a command is the repository's, as in a reader's
    argv = shlex.split(command)[1:]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == output.rstrip("\n"), f"{page}: `{command}` prints otherwise"
