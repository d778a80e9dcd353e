"""The command line: subcommands are found, and a user's mistake is one line, not a traceback."""

import subprocess
import sys


def test_help_lists_every_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "triollm.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("serve", "generate", "simulate"):
        assert name in out


def test_unknown_subcommand_exits_non_zero() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "triollm.cli", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
