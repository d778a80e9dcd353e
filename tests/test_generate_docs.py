"""Every code sample in docs/text.md runs: the Python blocks are executed and the shell
blocks are run as commands, from the repository root (so the docs cannot rot)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "text.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_page_has_samples() -> None:
    assert len(blocks("python")) >= 4 and len(blocks("sh")) >= 1


@pytest.mark.parametrize("source", blocks("python"), ids=lambda s: s.splitlines()[-1][:40])
def test_python_sample_runs(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    exec(compile(source, str(DOC), "exec"), {"__name__": "docs_text"})


@pytest.mark.parametrize(
    "command", [c for b in blocks("sh") for c in b.splitlines() if c.strip()], ids=str
)
def test_shell_sample_runs(command: str) -> None:
    argv = shlex.split(command)
    assert argv[0] == "triollm"
    proc = subprocess.run(
        [sys.executable, "-m", "triollm.cli", *argv[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
