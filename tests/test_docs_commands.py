"""Every shell block in docs/ is run by a test, or says on the page why it is not.

A ```sh (or ```bash, ```shell) block is a list of commands a reader pastes. Each line
of such a block is run here, through the CLI in-process, from a scratch directory that
sees the repository's folders (so `sim.html` lands in the scratch directory and
`tests/fixtures/...` still resolves). A block that cannot run in CI says so in its
fence, where the site shows it as the block's title:

    ```sh title="not run by the tests: it trains the model for 17 minutes"

and the reason must say something. A page whose own test runs its shell blocks is
listed in ``RUN_BY_THEIR_PAGES_TEST``; ```console blocks are
``tests/test_console_docs.py``'s, and every one of them must be a `$ triollm ...`
command it can run. An unlabelled fence is refused: a reader cannot tell a command
from an output, and neither can a test.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from triollm.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(.*)$")
SHELLS = {"sh", "bash", "shell"}
NOT_RUN = re.compile(r'^title="not run by the tests: (?P<why>[^"]*)"$')
CONSOLE = re.compile(r"```console\n\$ triollm [^\n]*\n")  # what test_console_docs runs

# Pages whose own test runs every line of their ```sh blocks.
RUN_BY_THEIR_PAGES_TEST = {"text.md": "tests/test_generate_docs.py"}

# Unlabelled fences on pages another issue's branch owns, until their owner labels them.
UNLABELLED_ELSEWHERE = {
    "policies.md": "its `triollm simulate` line is run by tests/test_policies_docs.py",
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    info: str  # the fence's info string: "sh", 'sh title="..."', "" ...
    body: str

    @property
    def language(self) -> str:
        return self.info.split(" ", 1)[0]

    @property
    def attributes(self) -> str:
        return self.info.partition(" ")[2].strip()

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if m is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append(Block(page.name, i + 1, m.group(1).strip(), "\n".join(lines[i + 1 : end])))
            i = end + 1
    return found


def _commands() -> list[tuple[Block, str]]:
    return [
        (b, line)
        for b in blocks()
        if b.language in SHELLS and not b.attributes and b.page not in RUN_BY_THEIR_PAGES_TEST
        for line in b.body.replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


COMMANDS = _commands()


def test_the_docs_have_shell_blocks_run_here_and_blocks_marked_not_run() -> None:
    assert len(COMMANDS) >= 3
    assert any(NOT_RUN.match(b.attributes) for b in blocks())


def test_every_fence_in_the_docs_names_its_language() -> None:
    unlabelled = [str(b) for b in blocks() if not b.info and b.page not in UNLABELLED_ELSEWHERE]
    assert unlabelled == [], "label these fences: `text` for output and drawings, `sh` to run"


def test_a_shell_block_is_run_here_by_its_pages_test_or_says_why_not() -> None:
    for b in blocks():
        if b.language not in SHELLS or not b.attributes:
            continue
        m = NOT_RUN.match(b.attributes)
        assert m is not None, f'{b}: the only attribute allowed is title="not run by the tests: …"'
        assert len(m.group("why").split()) >= 3, f"{b}: say why it is not run"


def test_the_pages_that_run_their_own_shell_blocks_do() -> None:
    for page, test in RUN_BY_THEIR_PAGES_TEST.items():
        source = (ROOT / test).read_text()
        assert page in source and 'blocks("sh")' in source, f"{test} no longer runs {page}"


def test_every_console_block_is_one_the_console_test_runs() -> None:
    for b in blocks():
        if b.language == "console":
            text = f"```console\n{b.body}\n"
            assert CONSOLE.match(text), f"{b}: a console block is `$ triollm ...` and its output"


@pytest.mark.parametrize(("block", "command"), COMMANDS, ids=[f"{b}: {c}" for b, c in COMMANDS])
def test_a_command_the_docs_show_runs(
    block: Block, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = shlex.split(command, comments=True)
    assert argv[0] == "triollm", (
        f'{block}: `{command}` is no triollm command; title it "not run by the tests: ..."'
    )
    for top in ("src", "tests", "docs", "bench"):
        (tmp_path / top).symlink_to(ROOT / top)
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0, f"{block}: `{command}` failed"
