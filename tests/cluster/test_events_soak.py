"""The KV events soak, short, in both encodings (``bench/bench_cluster.py --scenario
events`` runs the long one; docs/scale-out.md has its figures).

One server with a pool far smaller than the system prompts in use, a live subscriber
applying every batch as it arrives, waves of shared-prompt requests (some with two
choices, some left by their client after the first chunk). After every wave the
state rebuilt from the events alone must equal the pool's published set, with no
block announced before its parent and no sequence gap: the contract a prefix-aware
router relies on, in the positional encoding (llm-d) and the map (vLLM since 2026,
vllm-router).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_cluster

SOAK_S = 4  # seconds per encoding: a few waves, each of which evicts


async def test_a_short_soak_rebuilds_the_pool_exactly_in_either_encoding() -> None:
    from triollm.demo import resolve_model_dir
    from triollm.model.loader import load_model

    loaded = load_model(resolve_model_dir(None))  # once, for both encodings
    for encoding in ("array", "map"):
        args = bench_cluster.parser().parse_args(
            ["--scenario", "events", "--soak-s", str(SOAK_S), "--soak-encoding", encoding]
        )
        record = await bench_cluster.events(args, loaded)
        assert record["encoding"] == encoding
        assert record["waves"] >= 1, record
        assert record["ordering_violations"] == 0, record["violations_sample"]
        assert record["sequence_gaps"] == 0, record
        assert record["state_mismatches"] == 0, record
        # The soak exercised what it is for: evictions seen by the reader, clients
        # that left mid-answer.
        assert record["blocks_removed"] > 0, record
        assert record["clients_left_early"] > 0, record
