"""The arithmetic of an alternating run (triollm.bench.rounds) and of its tables
(tools/bench_peers_report.py), on plain numbers."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from triollm.bench.rounds import Summary, pair_rounds, summarize, table_row

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location(
        "bench_peers_report", ROOT / "tools" / "bench_peers_report.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers_report"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians() -> None:
    s = summarize({0: 10.0, 1: 30.0, 2: 20.0}, {0: 20.0, 1: 20.0, 2: 10.0})
    assert [r.ratio for r in s.rounds] == [0.5, 1.5, 2.0]
    assert s.ratio == 1.5  # median of 0.5, 1.5, 2.0
    assert (s.ours, s.peer) == (20.0, 20.0)  # medians of each side
    assert s.spread == (0.5, 2.0)


def test_rounds_on_both_sides_of_one_are_not_established() -> None:
    s = summarize({0: 9.0, 1: 11.0, 2: 9.5}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert s.verdict == "not established: the rounds disagree"


def test_three_agreeing_quiet_rounds_name_the_faster_system() -> None:
    slower = summarize({0: 6.0, 1: 7.0, 2: 6.5}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert slower.verdict == "llama.cpp faster"
    faster = summarize({0: 12.0, 1: 11.0, 2: 13.0}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert faster.verdict == "triollm faster"


def test_for_a_latency_a_ratio_above_one_means_triollm_is_slower() -> None:
    ttft = summarize({0: 900.0, 1: 1000.0, 2: 950.0}, {0: 70.0, 1: 75.0, 2: 74.0},
                     higher_is_better=False)  # fmt: skip
    assert ttft.verdict == "llama.cpp faster"


def test_busy_rounds_are_shown_marked_and_count_for_nothing() -> None:
    s = summarize({0: 6.0, 1: 30.0, 2: 7.0, 3: 6.5}, {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}, busy={1})
    assert s.per_round() == "0.60, 3.00 (busy), 0.70, 0.65"
    assert s.ratio == 0.65 and s.spread == (0.6, 0.7)
    assert s.ours == 6.5  # the busy round's 30.0 is not in the median
    assert s.verdict == "llama.cpp faster"
    assert s.as_json()["quiet_rounds"] == 3
    assert [r["busy"] for r in s.as_json()["per_round"]] == [False, True, False, False]


def test_fewer_than_three_quiet_rounds_establish_nothing() -> None:
    s = summarize({0: 6.0, 1: 7.0, 2: 6.0}, {0: 10.0, 1: 10.0, 2: 10.0}, busy={2})
    assert s.verdict == "not established: 2 quiet round(s) of the 3 needed"


def test_all_rounds_busy_gives_medians_of_all_but_no_verdict() -> None:
    s = summarize({0: 6.0, 1: 8.0}, {0: 10.0, 1: 10.0}, busy={0, 1})
    assert s.verdict == "busy machine: no quiet round"
    assert s.ratio == pytest.approx(0.7) and s.spread is None


def test_only_rounds_both_sides_measured_are_paired() -> None:
    rounds = pair_rounds({0: 1.0, 1: 2.0, 2: 3.0}, {1: 1.0, 2: 1.0, 5: 1.0}, busy=[2])
    assert [(r.round, r.busy) for r in rounds] == [(1, False), (2, True)]


def test_table_row_shows_median_spread_every_round_and_the_verdict() -> None:
    s = Summary(pair_rounds({0: 6.0, 1: 7.0, 2: 6.5}, {0: 10.0, 1: 10.0, 2: 10.0}, ()), True)
    assert table_row("decode b=1 tok/s", s) == (
        "| decode b=1 tok/s | 6.5 | 10.0 | 0.65x | 0.60-0.70 | 0.60, 0.70, 0.65 "
        "| llama.cpp faster |"
    )


def _rec(system: str, rnd: int, tok_s: float, busy: bool = False, **kw) -> dict:
    return {"model": "qwen1.5b", "part": "decode", "row": "decode b=1", "system": system,
            "round": rnd, "busy": busy, "tok_s": tok_s} | kw  # fmt: skip


def test_the_report_pairs_records_by_model_part_row_and_round(tmp_path: Path) -> None:
    report = _report()
    records = [
        _rec("llama.cpp", 0, 20.0), _rec("triollm", 0, 10.0),
        _rec("llama.cpp", 1, 20.0, busy=True), _rec("triollm", 1, 40.0, busy=True),
        _rec("llama.cpp", 2, 20.0), _rec("triollm", 2, 12.0),
        _rec("llama.cpp", 3, 20.0), _rec("triollm", 3, 11.0),
        {"model": "qwen1.5b", "part": "decode", "system": "triollm", "round": 4,
         "error": "bench_gguf.py exited 1"},
    ]  # fmt: skip
    (entry,) = report.summaries(records)
    s = entry["s"]
    assert s.per_round() == "0.50, 2.00 (busy), 0.60, 0.55"
    assert s.verdict == "llama.cpp faster" and s.ratio == 0.55
    meta = {
        "command": "python tools/bench_peers.py run", "date": "d0", "date_end": "d1",
        "cpu": "cpu", "cores": 2, "rounds": 4, "load_avg_start": [0.1], "load_avg_end": [0.2],
        "guard": {"threshold_cores": 0.25, "window_s": 3, "max_wait_s": 120},
        "scrubbed_from_children": ["OPENBLAS_CORETYPE"],
        "workload": {"threads": 2, "prompt": 32, "new": 32, "batches": [1], "prefill": [512],
                     "depth": 4096, "depth_new": 32, "concurrency": [1], "serve_requests": 8,
                     "serve_prompt": 32, "serve_new": 32, "slot_context": 512},
        "models": {"qwen1.5b": {"title": "Qwen", "pairing": "the same file"}},
    }  # fmt: skip
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rounds = [{"model": "qwen1.5b", "round": i, "busy": i == 1, "others_cores_during": 0.1 * i}
              for i in range(4)]  # fmt: skip
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    lines, summary = report.section(tmp_path)
    text = "\n".join(lines)
    assert "4 rounds run, 1 marked busy" in text
    assert "| decode b=1 tok/s | 11.0 | 20.0 | 0.55x | 0.50-0.60 | 0.50, 2.00 (busy), 0.60, 0.55 " \
        "| llama.cpp faster |" in text  # fmt: skip
    assert "round 5, triollm: failed: `bench_gguf.py exited 1`" in text
    assert summary[0]["verdict"] == "llama.cpp faster" and summary[0]["quiet_rounds"] == 3


def test_tables_can_judge_the_recorded_rounds_again_at_another_threshold() -> None:
    report = _report()
    records = [_rec("llama.cpp", 0, 20.0, busy=True), _rec("triollm", 0, 10.0, busy=True),
               _rec("llama.cpp", 1, 20.0), _rec("triollm", 1, 12.0)]  # fmt: skip
    rounds = [
        {"model": "qwen1.5b", "group": ["decode"], "round": 0, "busy": True,
         "others_cores_before": 0.2, "others_cores_during": 0.05},
        {"model": "qwen1.5b", "group": ["decode"], "round": 1, "busy": False,
         "others_cores_before": 0.01, "others_cores_during": 0.4},
    ]  # fmt: skip
    recs, rnds = report.rejudge(records, rounds, threshold=0.3)
    assert [r["busy"] for r in rnds] == [False, True]
    assert [r["busy"] for r in recs] == [False, False, True, True]


def test_tables_over_several_runs_take_each_model_from_the_last_run_that_measured_it(
    tmp_path: Path,
) -> None:
    """A model re-measured after a change replaces its earlier figures in the plots; a model
    only the earlier run measured keeps them (each run's own header says when and at which
    commit)."""
    report = _report()
    runs = []
    for name, models, tok in (("a", ("qwen1.5b", "smollm2"), 10.0), ("b", ("qwen1.5b",), 30.0)):
        d = tmp_path / name
        d.mkdir()
        meta = {"date": name, "commit": f"c-{name}",
                "models": {m: {"title": m, "pairing": "same"} for m in models}}  # fmt: skip
        (d / "meta.json").write_text(json.dumps(meta))
        recs = [{"model": m, "part": "decode", "system": "triollm", "round": 0, "tok_s": tok}
                for m in models]  # fmt: skip
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (d / "rounds.jsonl").write_text("")
        runs.append(d)
    meta, records = report.merged(runs, None)
    assert sorted(meta["models"]) == ["qwen1.5b", "smollm2"] and meta["commit"] == "c-b"
    by_model = {r["model"]: r["tok_s"] for r in records}
    assert by_model == {"qwen1.5b": 30.0, "smollm2": 10.0}
    assert len(records) == 2


def test_serve_rows_name_itl_per_token_only_when_the_client_timed_tokens() -> None:
    """Runs from before the client counted tokens per chunk hold chunk gaps under
    ``itl_ms``; their rows are labelled "chunk gap", the new ones "ITL", and TPOT has
    a row of its own."""
    report = _report()

    def serve(system: str, rnd: int, ms: float, per_token: bool) -> dict:
        r = {"model": "qwen1.5b", "part": "serve", "row": "c=1", "system": system,
             "round": rnd, "aggregate_tok_s": 10.0, "ttft_ms": {"p50": ms},
             "tpot_ms": {"p50": ms}, "itl_ms": {"p50": ms, "p99": ms}}  # fmt: skip
        return r | {"itl_definition": "per token"} if per_token else r

    def labels(per_token: bool) -> set[str]:
        sides = ("triollm", "llama.cpp")
        records = [serve(s, i, 10.0, per_token) for s in sides for i in (0, 1, 2)]
        return {e["metric"] for e in report.summaries(records)}

    assert {"TPOT p50 ms", "ITL p50 ms", "ITL p99 ms"} <= labels(True)
    old = labels(False)
    assert {"chunk gap p50 ms", "chunk gap p99 ms"} <= old and "ITL p99 ms" not in old


def test_a_run_of_one_part_replaces_only_that_part_of_a_model(tmp_path: Path) -> None:
    """A depth-only run (the 16 384-position one) keeps the model's decode rounds from
    the earlier run: merging by model alone dropped them from the plots."""
    report = _report()
    runs = []
    for name, part, tok in (("a", "decode", 10.0), ("a2", "depth", 5.0), ("b", "depth", 7.0)):
        d = tmp_path / name
        d.mkdir()
        meta = {"date": name, "models": {"qwen1.5b": {"title": "q", "pairing": "same"}}}
        (d / "meta.json").write_text(json.dumps(meta))
        rec = {"model": "qwen1.5b", "part": part, "system": "triollm", "round": 0, "tok_s": tok}
        (d / "records.jsonl").write_text(json.dumps(rec) + "\n")
        (d / "rounds.jsonl").write_text("")
        runs.append(d)
    _, records = report.merged(runs, None)
    assert sorted((r["part"], r["tok_s"]) for r in records) == [("decode", 10.0), ("depth", 7.0)]


def _tiny_gguf(path: Path, *, tied: bool) -> int:
    """A GGUF with a llama header and float32 tensors; the bytes a step reads."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    tensors = {"token_embd.weight": np.zeros((100, 32), np.float32)}
    tensors |= {f"blk.{i}.attn_q.weight": np.zeros((32, 32), np.float32) for i in range(2)}
    if not tied:
        tensors["output.weight"] = np.zeros((100, 32), np.float32)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 4 * (100 * 32 + 2 * 32 * 32)  # the head once, tied or not; the embedding not again


def test_a_step_reads_the_head_once_and_two_bytes_of_k_and_v_per_layer_and_kv_head(
    tmp_path: Path, monkeypatch
) -> None:
    """The floor's bytes come from the file: every multiplied tensor, the token embedding
    only when it is also the head; K/V per position = 2 (K, V) x layers x KV heads x
    head_dim x 2 bytes. Counting the untied embedding too would lower the floor."""
    report = _report()
    monkeypatch.setattr(report, "BYTES_CACHE", tmp_path / "cache.json")
    for tied in (True, False):
        f = tmp_path / f"m-{tied}.gguf"
        want = _tiny_gguf(f, tied=tied)
        b = report.step_bytes(str(f))
        assert b == {"weights": want, "kv_per_position": 2 * 2 * 2 * (32 // 4) * 2}
    assert report.step_bytes(str(tmp_path / "hf-dir")) is None


def test_the_floor_of_a_row_is_its_tokens_per_step_over_the_bytes_a_step_reads() -> None:
    report = _report()
    b = {"weights": 1_000_000_000, "kv_per_position": 28_672}
    w = {"prompt": 32, "new": 32, "depth_new": 32}
    depth = report._floor("decode after 4096", {"part": "depth", "depth": 4096}, w, b, 33.0)
    assert math.isclose(depth, 33e9 / (1e9 + (4096 + 16) * 28_672))
    b16 = report._floor("decode b=16", {"part": "decode", "batch": 16}, w, b, 33.0)
    assert math.isclose(b16, 16 * 33e9 / (1e9 + 16 * 48 * 28_672))
    assert report._floor("prefill 512", {"part": "prefill"}, w, b, 33.0) is None


def test_the_long_context_table_keeps_each_row_from_the_last_run_that_measured_it(
    tmp_path: Path,
) -> None:
    """A run at depth 16384 adds its row beside the earlier run's depth 4096 row; a row
    measured again replaces the older one (keyed by the part alone, the 4096 row was lost)."""
    report = _report()
    runs = []
    for name, rows in (("a", (("decode b=1", 10.0), ("decode after 4096", 5.0))),
                       ("b", (("decode after 16384", 3.0),)),
                       ("c", (("decode b=1", 20.0),))):  # fmt: skip
        d = tmp_path / name
        d.mkdir()
        meta = {"date": f"2026-12-02T0{len(runs)}:00", "commit": name,
                "models": {"q": {"title": "Q", "ours": str(tmp_path / "hf-dir")}},
                "workload": {"prompt": 32, "new": 32, "depth_new": 32}}  # fmt: skip
        (d / "meta.json").write_text(json.dumps(meta))
        recs = [
            {"model": "q", "part": "decode" if "b=" in row else "depth", "row": row,
             "system": system, "round": rnd, "tok_s": tok * (2 if system == "triollm" else 1)}
            for row, tok in rows for system in ("triollm", "llama.cpp") for rnd in range(3)
        ]  # fmt: skip
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (d / "rounds.jsonl").write_text("")
        runs.append(d)
    lines = [x for x in report.long_context(runs) if x.startswith("| Q |")]
    got = [(x.split(" | ")[1], x.split(" | ")[2], x.split("`")[1]) for x in lines]
    assert got == [("decode b=1", "40.0", "c"), ("decode after 4096", "10.0", "a"),
                   ("decode after 16384", "6.0", "b")]  # fmt: skip


def test_a_target_is_met_only_when_the_median_reaches_it_and_says_which_rounds_fell_short() -> None:
    report = _report()
    peer = {0: 10.0, 1: 10.0, 2: 10.0}
    assert report.target_status(summarize({0: 14.0, 1: 13.5, 2: 13.1}, peer), 1.3) == "met"
    assert report.target_status(summarize({0: 14.0, 1: 13.5, 2: 12.0}, peer), 1.3) == (
        "met by the median (1 of 3 rounds short)"
    )
    assert report.target_status(summarize({0: 14.0, 1: 12.9, 2: 11.0}, peer), 1.3) == "**missed**"
    # a latency's target is a ceiling: TTFT 0.9x of the peer's meets "<= 1.0x"
    ttft = summarize({0: 9.0, 1: 9.5, 2: 8.0}, peer, higher_is_better=False)
    assert report.target_status(ttft, 1.0) == "met"
    assert report.target_status(summarize({0: 14.0, 1: 14.0}, {0: 10.0, 1: 10.0}), 1.3) == (
        "not judged: 2 quiet round(s)"
    )
    busy = summarize({0: 14.0, 1: 14.0, 2: 30.0}, peer, busy={2})
    assert report.target_status(busy, 1.3) == "not judged: 2 quiet round(s)"


def test_the_targets_table_takes_each_row_from_the_last_run_that_measured_it(
    tmp_path: Path,
) -> None:
    report = _report()
    runs = []
    for name, rows in (("a", (("decode b=1", 1.0), ("decode after 16384", 2.0))),
                       ("b", (("decode b=1", 1.4), ("decode after 4096", 1.2)))):  # fmt: skip
        d = tmp_path / name
        d.mkdir()
        meta = {"date": f"2026-12-02T0{len(runs)}:00", "commit": name,
                "models": {"qwen1.5b": {"title": "Q", "ours": "x"}}}  # fmt: skip
        (d / "meta.json").write_text(json.dumps(meta))
        recs = [
            {"model": "qwen1.5b", "part": "decode" if "b=" in row else "depth", "row": row,
             "system": system, "round": rnd, "tok_s": 10.0 * (ratio if system == "triollm" else 1)}
            for row, ratio in rows for system in ("triollm", "llama.cpp") for rnd in range(3)
        ]  # fmt: skip
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (d / "rounds.jsonl").write_text("")
        runs.append(d)
    lines = report.targets(runs)
    rows = {x.split(" | ")[1]: x for x in lines if x.startswith("| Q |")}
    assert "| 1.40x | 1.40, 1.40, 1.40 | met | 2026-12-02 01:00, `b` |" in rows["decode b=1 tok/s"]
    assert "| **missed** |" in rows["decode after 4096 tok/s"]
    assert "| met | 2026-12-02 00:00, `a` |" in rows["decode after 16384 tok/s"]
    assert "| qwen1.5b | c=1 aggregate tok/s | — | — | — | not measured |" in "\n".join(lines)
