"""Side-by-side ratios: rows match by name, repeats reduce to medians."""

from __future__ import annotations

import json

import pytest

from triollm.bench.compare import ENGINE_METRICS, SERVE_METRICS, ratio_table, ratios, read_jsonl
from triollm.errors import UserError


def serve(row: str, tok_s: float, ttft: float) -> dict:
    return {"row": row, "aggregate_tok_s": tok_s, "ttft_ms": {"p50": ttft}, "itl_ms": {}}


def test_ratios_are_ours_over_the_peers_medians_of_the_alternating_rounds() -> None:
    ours = [serve("c=1", 40, 70), serve("c=1", 60, 90), serve("c=1", 50, 80), serve("c=4", 1, 1)]
    peer = [serve("c=1", 100, 20), serve("c=1", 80, 40)]
    (entry,) = ratios(ours, peer, SERVE_METRICS)  # c=4 has no peer row
    assert entry["row"] == "c=1"
    assert entry["aggregate_tok_s"]["ratio"] == pytest.approx(50 / 90)
    assert entry["ttft_ms.p50"]["ratio"] == pytest.approx(80 / 30)
    assert "itl_ms.p99" not in entry  # neither side measured it


def test_the_table_shows_both_figures_the_ratio_and_every_repeat() -> None:
    table = ratio_table(
        [{"row": "decode b=1 16-bit", "tok_s": t} for t in (30.0, 20.0, 40.0)],
        [{"row": "decode b=1 16-bit", "tok_s": t} for t in (100.0, 100.0, 80.0)],
        ENGINE_METRICS,
        ours_name="triollm",
        peer_name="llama.cpp",
    )
    assert table.splitlines()[0].startswith("| row | triollm | llama.cpp | ratio (median) |")
    assert table.splitlines()[2] == (
        "| decode b=1 16-bit tok/s | 30.0 | 100 | 0.30x | 0.20-0.50 | 0.30, 0.20, 0.50 "
        "| llama.cpp faster |"
    )


def test_one_repeat_or_repeats_on_both_sides_of_one_establish_nothing() -> None:
    one = ratio_table([serve("c=1", 50, 80)], [serve("c=1", 100, 40)], SERVE_METRICS)
    assert "not established: 1 quiet round(s) of the 3 needed" in one
    split = ratio_table(
        [serve("c=1", t, 1) for t in (90, 110, 95)],
        [serve("c=1", 100, 1) for _ in range(3)],
        SERVE_METRICS[:1],
    )
    assert split.splitlines()[2].endswith("| not established: the rounds disagree |")


def test_a_results_file_that_is_not_json_lines_names_the_line(tmp_path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"row": "c=1"}) + "\n{oops\n")
    with pytest.raises(UserError, match=r"r.jsonl:2: not a JSON line"):
        read_jsonl(p)
    p.write_text(json.dumps({"no_row": 1}) + "\n")
    with pytest.raises(UserError, match="needs a 'row'"):
        read_jsonl(p)
