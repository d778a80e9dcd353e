"""The policy layer is pure: importing it must not pull in trio or numpy."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_policy_layer_and_the_messages_imports_neither_trio_nor_numpy() -> None:
    code = (
        "import json, sys\n"
        "import triollm.kv, triollm.kvcache, triollm.policies, triollm.scheduler, triollm.sizing\n"
        "import triollm.textstream, triollm.events, triollm.outcomes, triollm.errors\n"
        "print(json.dumps(sorted(m for m in ('trio', 'numpy', 'numba') if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []
