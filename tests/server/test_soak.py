"""A short soak in CI: bench/soak.py's mixed, careless and hostile clients for a few
seconds, then every promise checked at rest (``just soak`` runs the long one).

What it asserts (the soak's own checks): no 5xx, every refusal shaped (a 429 with
Retry-After, a 4xx for each hostile body), no truncated 200, every KV block back, no
request and no task left, RSS growth within the bound, the same greedy text as at
the start.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak

CI_SECONDS = 8
CI_RSS_BOUND_MIB = 100


async def test_a_short_soak_leaves_the_server_as_it_found_it():
    out = io.StringIO()
    figures = await soak.soak(
        seconds=CI_SECONDS,
        requests=2000,
        clients=4,
        seed=1,
        rss_bound_mib=CI_RSS_BOUND_MIB,
        out=out,
    )
    assert figures["failures"] == [], out.getvalue()
    assert figures["server_errors"] == 0
    kinds = {label.split(":")[0] for label in figures["outcomes"]}
    assert {"stream", "whole", "cut", "malformed"} <= kinds, figures["outcomes"]
