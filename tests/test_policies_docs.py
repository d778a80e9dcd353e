"""docs/policies.md builds a policy file from its Python blocks and quotes what
`triollm check-policy` prints for it: a real counter-example, then a proof.

Each ```text block that starts with `$ triollm check-policy` is run in a fresh
directory holding the file as the page has built it so far; its output must be
the page's, except the number of runs and the seconds, which vary by machine.
This is also the counter-check that the harness finds shortest-prompt-first's
starvation with its full shrinking.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from triollm.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "policies.md"
BLOCK = re.compile(r"```(python|text)\n(.*?)```", re.S)
TIMING = re.compile(r"\d+ run\(s\)|\d+(\.\d+)? s\b")


def _mask(text: str) -> str:
    return TIMING.sub("#", text).rstrip("\n")


def _steps() -> list[tuple[str, str, str]]:
    """(file so far, command, quoted output) for each quoted check-policy run."""
    source, runs = "", []
    for kind, body in BLOCK.findall(DOC.read_text()):
        if kind == "python":
            source += body + "\n"
        elif body.startswith("$ triollm check-policy"):
            command, _, output = body.partition("\n")
            runs.append((source, command[2:], output))
    return runs


def test_the_page_quotes_a_counter_example_and_then_a_proof() -> None:
    runs = _steps()
    assert len(runs) == 2
    assert "VIOLATED" in runs[0][2] and "the shrunk counter-example" in runs[0][2]
    assert "held: all 5 claim(s)" in runs[1][2]


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["the counter-example", "the proof"])
def test_check_policy_prints_what_the_page_shows(
    index: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source, command, quoted = _steps()[index]
    (tmp_path / "shortest_prompt_first.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)[1:]
    # Shrinking runs to the end here, whatever the machine's load: the page's story
    # is the fully shrunk one, and hypothesis shrinks deterministically.
    status = main([*argv, "--quiet", "--shrink-time", "100000"])
    printed = capsys.readouterr().out
    assert status == (1 if index == 0 else 0)
    assert _mask(printed) == _mask(quoted), printed
    if index == 0:  # the replay the page promises exists and simulates
        replay = next(tmp_path.glob("check-policy-*.json"))
        assert main(["simulate", str(replay), "--policy", argv[1]]) == 0


def test_the_use_commands_on_the_page_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _steps()[-1][0]
    (tmp_path / "shortest_prompt_first.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    line = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("triollm simulate"))
    assert main(shlex.split(line)[1:]) == 0
    assert "== shortest-prompt-first-aged:" in capsys.readouterr().out
