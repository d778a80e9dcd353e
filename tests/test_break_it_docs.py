"""The "break it" table in docs/break-it.md is current (cheap checks; the run itself
is ``python tools/break_it.py``, too long for CI).

A row whose edit changed since it was recorded fails here until
``python tools/break_it.py --stale`` records it again (the page meanwhile shows it as
"not recorded for this edit yet": it is rendered from the record and the edit list
together, and the page test below keeps the quote equal to that rendering).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("break_it", ROOT / "tools" / "break_it.py")
assert _spec is not None and _spec.loader is not None
break_it = importlib.util.module_from_spec(_spec)
sys.modules["break_it"] = break_it  # dataclasses look their module up by name
_spec.loader.exec_module(break_it)


def test_every_edit_still_applies_to_todays_code_exactly_once() -> None:
    for m in break_it.MUTATIONS:
        count = (ROOT / m.path).read_text().count(m.old)
        assert count == 1, f"{m.key}: its snippet occurs {count} times in {m.path}"


def test_the_record_names_only_rows_of_todays_list() -> None:
    recorded = json.loads(break_it.RESULTS.read_text())
    assert set(recorded) <= {m.key for m in break_it.MUTATIONS}


def test_every_row_is_recorded_from_its_edit_as_it_is_today() -> None:
    recorded = json.loads(break_it.RESULTS.read_text())
    stale = [
        m.key
        for m in break_it.MUTATIONS
        if recorded.get(m.key, {}).get("digest") != break_it.digest(m)
    ]
    assert stale == [], f"run `python tools/break_it.py --stale` to record {stale}"


def test_no_recorded_mechanism_is_one_that_no_test_protects() -> None:
    recorded = json.loads(break_it.RESULTS.read_text())
    assert [k for k, row in recorded.items() if not row["failing"]] == []


def test_the_page_quotes_the_recorded_table() -> None:
    recorded = json.loads(break_it.RESULTS.read_text())
    page = break_it.PAGE.read_text()
    quoted = page.split(break_it.BEGIN, 1)[1].split(break_it.END, 1)[0].strip()
    assert quoted == break_it.render_table(recorded)


def test_each_exercise_runs_a_test_its_row_was_recorded_failing() -> None:
    """`--try KEY` runs one test (PROOFS): one the row's own run saw fail, so the
    exercise shows the mechanism's guard, not a test that happens to pass."""
    recorded = json.loads(break_it.RESULTS.read_text())
    assert set(break_it.PROOFS) == {m.key for m in break_it.MUTATIONS}
    for key, proof in break_it.PROOFS.items():
        assert proof in recorded[key]["failing"], f"{key}: {proof} was not seen failing"


def test_the_reservation_row_fails_on_the_deadlock_not_on_the_policy_guard() -> None:
    """Row 3 breaks reservation the way the Scheduler's guard allows (grow a block at a
    time): its failures must include the simulator's deadlock, not the guard alone."""
    recorded = json.loads(break_it.RESULTS.read_text())["no-answer-reservation"]
    assert any(t.startswith("tests/test_sim.py::") for t in recorded["failing"])
