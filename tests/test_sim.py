"""`triollm simulate`: the seed's scenario under each policy, scenario files, the page."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from triollm.cli import main
from triollm.errors import UserError
from triollm.scheduler import Policy
from triollm.sim.page import render_page
from triollm.sim.runner import simulate
from triollm.sim.scenario import (
    Scenario,
    SimRequest,
    load_scenario,
    parse_scenario,
    seed_scenario,
)


def test_the_seed_scenario_is_the_figures_constants() -> None:
    sc = seed_scenario()
    assert (sc.slots, sc.block_size, sc.chunk_tokens, sc.step_rows) == (4, 4, 8, 12)
    assert len(sc.requests) == 7


def test_in_the_seed_scenario_only_free_slot_deadlocks() -> None:
    runs = {p: simulate(seed_scenario(), p) for p in Policy}
    for policy in (Policy.STATIC, Policy.RESERVE, Policy.PREEMPT):
        run = runs[policy]
        assert run.deadlock is None
        assert all(o.done is not None for o in run.outcomes), policy
    dead = runs[Policy.FREE_SLOT].deadlock
    assert dead is not None
    # Every stuck request holds blocks and needs one more; the pool has none free.
    assert dead.holders and all(held > 0 and need >= 1 for _, held, need in dead.holders)
    assert dead.description.startswith("0 block(s) free")
    stuck = {o.name for o in runs[Policy.FREE_SLOT].outcomes if o.done is None}
    assert stuck == {name for name, _, _ in dead.holders}


def test_continuous_batching_beats_request_level_batching_on_the_seed() -> None:
    static = simulate(seed_scenario(), Policy.STATIC)
    reserve = simulate(seed_scenario(), Policy.RESERVE)
    assert reserve.total_steps < static.total_steps
    assert sum(o.ttft or 0 for o in reserve.outcomes) < sum(o.ttft or 0 for o in static.outcomes)


def test_every_request_takes_at_least_its_own_work() -> None:
    sc = seed_scenario()
    for policy in (Policy.STATIC, Policy.RESERVE, Policy.PREEMPT):
        for o in simulate(sc, policy).outcomes:
            assert o.ttft is not None and o.completion is not None
            assert o.ttft >= -(-o.prompt // sc.chunk_tokens)  # one chunk per step at most
            assert o.completion >= o.ttft + o.answer - 1  # one decode row per step at most


def test_a_step_never_exceeds_the_rows_or_the_slots() -> None:
    sc = seed_scenario()
    for policy in Policy:
        for step in simulate(sc, policy).steps:
            assert sum(r.rows for r in step.rows) <= sc.step_rows
            assert all(r.rows <= sc.chunk_tokens for r in step.rows)
            assert len(step.slots) == sc.slots and len(step.blocks) == sc.num_blocks


def test_a_request_that_can_never_fit_is_refused_not_queued() -> None:
    sc = Scenario(2, 4, 4, 8, 12, 64, (SimRequest("A", 0, 10, 2), SimRequest("B", 0, 30, 5)))
    run = simulate(sc, Policy.RESERVE)
    b = run.outcomes[1]
    assert b.refused is not None and "need 9 blocks of 4" in b.refused
    assert run.outcomes[0].done is not None


def test_a_scenario_file_can_be_json_or_toml(tmp_path: Path) -> None:
    body = {
        "slots": 2,
        "num_blocks": 8,
        "block_size": 4,
        "chunk_tokens": 4,
        "step_rows": 6,
        "requests": [{"name": "x", "arrival": 0, "prompt": 5, "answer": 3}],
    }
    (tmp_path / "s.json").write_text(json.dumps(body))
    (tmp_path / "s.toml").write_text(
        "slots = 2\nnum_blocks = 8\nblock_size = 4\nchunk_tokens = 4\nstep_rows = 6\n"
        '[[requests]]\nname = "x"\narrival = 0\nprompt = 5\nanswer = 3\n'
    )
    a, b = load_scenario(tmp_path / "s.json"), load_scenario(tmp_path / "s.toml")
    assert a.requests == b.requests and a.context_tokens == 32  # defaults to the pool


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"slots": 0}, "field 'slots' must be an integer >= 1"),
        ({"requests": []}, "field 'requests' must be a non-empty list"),
        ({"requests": [{"arrival": 0, "prompt": 0, "answer": 1}]}, "requests[0].prompt"),
        ({"step_rows": 1}, "step_rows (1) must be >= slots (2)"),
        ({"colour": "red"}, "unknown field(s) ['colour']"),
    ],
)
def test_a_bad_scenario_names_the_field(
    tmp_path: Path, body: dict[str, object], message: str
) -> None:
    good: dict[str, object] = {
        "slots": 2,
        "num_blocks": 8,
        "block_size": 4,
        "chunk_tokens": 4,
        "step_rows": 6,
        "requests": [{"arrival": 0, "prompt": 5, "answer": 3}],
    }
    good.update(body)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(good))
    with pytest.raises(UserError) as err:
        load_scenario(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_simulate_prints_a_table_per_policy_and_the_deadlock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page = tmp_path / "sim.html"
    assert main(["simulate", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    for policy in Policy:
        assert f"== {policy.value}:" in out
    assert "DEADLOCK at step" in out and "never finish:" in out
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained
    assert html.count('"policy":') == 4


def test_simulate_reports_a_missing_scenario_as_a_user_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "/nonexistent/scenario.json"]) == 2
    assert "cannot read the scenario" in capsys.readouterr().err


def test_the_page_cannot_be_broken_out_of_by_a_request_name() -> None:
    sc = Scenario(1, 4, 4, 4, 4, 16, (SimRequest("</script><b>", 0, 2, 2),))
    html = render_page([simulate(sc, Policy.RESERVE)])
    assert html.count("</script>") == 1


def test_a_preempted_request_is_recomputed_from_position_zero_when_readmitted() -> None:
    run = simulate(seed_scenario(), Policy.PREEMPT)
    evicted = [o for o in run.outcomes if o.preemptions]
    assert evicted and all(o.done is not None for o in evicted)
    for o in evicted:
        readmitted = next(s for s in run.steps if f"{o.name} readmitted" in s.events)
        (row,) = [r for r in readmitted.rows if r.request == o.name]
        assert (row.kind, row.start) == ("prefill", 0)


def test_the_page_steps_through_every_recorded_step_of_every_policy() -> None:
    from triollm.sim.page import page_data

    runs = [simulate(seed_scenario(), p) for p in Policy]
    data = page_data(runs)
    assert [r["policy"] for r in data["runs"]] == [p.value for p in Policy]
    for run, shown in zip(runs, data["runs"], strict=True):
        assert len(shown["steps"]) == run.total_steps
    i = list(Policy).index(Policy.FREE_SLOT)
    expected = runs[i].deadlock
    assert expected is not None and data["runs"][i]["deadlock"]["t"] == expected.t


def shared(n: int) -> Scenario:
    from dataclasses import replace

    return replace(seed_scenario(), shared_prefix=n, prefix_cache=True)


def test_the_shared_prefix_variant_skips_the_cached_opening_and_ends_sooner() -> None:
    plain = simulate(seed_scenario(), Policy.RESERVE)
    run = simulate(shared(12), Policy.RESERVE)
    found = {o.name: o.cached_tokens for o in run.outcomes}
    # A computes the opening; later prompts long enough hold its 3 full blocks (C and
    # G, of 10 and 11 tokens, recompute their last partial block: 2 blocks each).
    assert found == {"A": 0, "B": 0, "C": 8, "D": 12, "E": 0, "F": 12, "G": 8}
    assert run.total_steps < plain.total_steps
    assert any(s.shared for s in run.steps)  # some step shows a block two requests hold
    prefills = {r.request: r.start for s in run.steps for r in s.rows if r.kind == "prefill"}
    assert prefills["D"] >= 12  # D's first chunk starts past the cached opening


def test_with_the_cache_off_a_shared_opening_changes_nothing() -> None:
    from dataclasses import replace

    plain = simulate(seed_scenario(), Policy.RESERVE)
    same = simulate(replace(seed_scenario(), shared_prefix=12), Policy.RESERVE)
    assert same.steps == plain.steps and same.outcomes == plain.outcomes


def test_simulate_shared_prefix_prints_what_the_cache_found(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--shared-prefix", "12", "--policy", "reserve"]) == 0
    out = capsys.readouterr().out
    assert "40 of 79 prompt tokens found cached at admission (C 8, D 12, F 12, G 8)" in out
    page = render_page([simulate(shared(12), Policy.RESERVE)])
    assert '"prefix_cache":true' in page and '"shared":[' in page


def test_a_scenario_can_end_early_cancel_and_reserve_more_than_it_writes() -> None:
    sc = parse_scenario(
        {
            "slots": 2,
            "num_blocks": 8,
            "block_size": 4,
            "chunk_tokens": 8,
            "step_rows": 12,
            "requests": [
                {"name": "eos", "arrival": 0, "prompt": 4, "answer": 2, "max_tokens": 12},
                {"name": "gone", "arrival": 0, "prompt": 4, "answer": 9, "cancel": 3},
            ],
            "overtake_limit": 0,
        },
        "<test>",
    )
    run = simulate(sc, Policy.RESERVE)
    eos, gone = run.outcomes
    assert eos.done == 1  # the model said EOS at its 2nd token, not at max_tokens
    assert run.steps[0].blocks.count("eos") == 4  # but the reservation was for 12 tokens
    assert gone.done is None and "gone cancelled" in run.steps[3].events
    with pytest.raises(UserError, match=r"requests\[0\]\.max_tokens must be an integer >= 3"):
        parse_scenario(
            {**sc_dict(), "requests": [{"arrival": 0, "prompt": 1, "answer": 3, "max_tokens": 2}]},
            "<test>",
        )


def sc_dict() -> dict[str, object]:
    return {"slots": 1, "num_blocks": 8, "block_size": 4, "chunk_tokens": 8, "step_rows": 12}


def test_past_its_last_step_a_finished_run_is_empty_and_a_deadlocked_run_stays_locked() -> None:
    """The page's runs end at different steps; past its end a finished run shows every
    slot and block free (not its last recorded step, taken before the last commit:
    G still in a slot) and a deadlocked run its full pool, as its red box says."""
    from triollm.sim.page import page_data

    runs = [simulate(seed_scenario(), p) for p in (Policy.RESERVE, Policy.FREE_SLOT)]
    reserve, free_slot = page_data(runs)["runs"]
    assert any(n is not None for n in reserve["steps"][-1]["slots"])  # why "end" exists
    end = reserve["end"]
    assert end["slots"] == [None] * 4 and end["blocks"] == [None] * 14
    assert end["rows"] == [] and end["tables"] == [] and end["waiting"] == []
    locked = free_slot["end"]
    assert locked == free_slot["steps"][-1] and "DEADLOCK" in locked["events"]
    assert None not in locked["blocks"]  # 0 free, beside the box that says 0 free
    template = (Path(page_data.__code__.co_filename).parent / "page.html").read_text()
    assert "run.end" in template  # the script shows it past a run's last step


def test_each_step_records_every_running_requests_block_table_in_position_order() -> None:
    """The page's live block tables: each running request's table is the blocks it
    holds in the pool, and under free-slot they grow a block at a time."""
    run = simulate(seed_scenario(), Policy.FREE_SLOT)
    for step in run.steps:
        assert {name for name, _, _ in step.tables} == {n for n in step.slots if n}
        for name, blocks, written in step.tables:
            assert all(step.blocks[b] == name for b in blocks)
            assert written <= len(blocks) * run.scenario.block_size
    sizes = [{n: len(b) for n, b, _ in s.tables} for s in run.steps]
    assert any(b.get(n, 0) > a.get(n, 99) for a, b in itertools.pairwise(sizes) for n in b)


def test_the_page_and_the_figures_share_one_colour_scheme() -> None:
    from triollm.sim.page import page_data
    from triollm.sim.palette import FREE, PALETTE

    data = page_data([simulate(seed_scenario(), Policy.RESERVE)])
    assert data["palette"] == list(PALETTE) and data["free"] == FREE
    root = Path(__file__).resolve().parents[1]
    template = (root / "src" / "triollm" / "sim" / "page.html").read_text()
    assert not re.search(r"#[0-9a-f]{6}\", \"#", template)  # no colour list of its own
    figures = (root / "tools" / "figures.py").read_text()
    assert "from triollm.sim.palette import" in figures and "get_cmap" not in figures
