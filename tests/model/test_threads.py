"""The threading set-up: passive OpenMP workers inside, nothing left for child processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A child imports the kernels, runs one parallel kernel, then starts a grandchild
# that prints whether it inherited the variable. OMP_DISPLAY_ENV makes libgomp
# print the wait policy it read when it loaded, on stderr.
_CHILD = """
import os, subprocess, sys
import numpy as np
import triollm.model.matmul, triollm.model.kernels, triollm.model.quant
from triollm.model import kernels
x = np.ones((2, 8), np.float32); out = np.empty_like(x)
kernels.rms_norm(x, np.ones(8, np.float32), np.float32(1e-5), out)
print("self", os.environ.get("OMP_WAIT_POLICY"))
grandchild = "import os; print('child', os.environ.get('OMP_WAIT_POLICY'))"
sys.stdout.flush()
subprocess.run([sys.executable, "-c", grandchild], check=True)
"""


def _run(preset: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_DISPLAY_ENV"] = "TRUE"
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    return subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )


def test_the_runtime_waits_passively_and_no_child_inherits_the_setting() -> None:
    # Spinning workers made a shared-core step 10x slower (docs/performance.md), so
    # the runtime must read PASSIVE; but a peer benchmark started from this process
    # inherited the variable and ran handicapped, so it must not stay in os.environ.
    out = _run(None)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr
    assert out.stdout.split("\n")[:2] == ["self None", "child None"]


@pytest.mark.parametrize("preset", ["ACTIVE", "PASSIVE"])
def test_a_wait_policy_the_user_chose_wins_and_stays_theirs(preset: str) -> None:
    out = _run(preset)
    assert f"OMP_WAIT_POLICY = '{preset}'" in out.stderr
    assert out.stdout.split("\n")[:2] == [f"self {preset}", f"child {preset}"]
