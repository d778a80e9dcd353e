"""Break each mechanism on purpose and record which tests notice: the "break it" table.

A mechanism is only as real as the test that fails without it. For each row of
``MUTATIONS`` this tool copies the project's tracked files to a scratch directory,
applies the smallest edit that removes the mechanism (one exact snippet replaced by
another), runs the tests of the layers the edit touches, and records every test that
failed. It writes ``docs/break-it.json`` and the table between the markers in
``docs/break-it.md``.

    python tools/break_it.py            # every row (tens of minutes: one test run a row)
    python tools/break_it.py --only no-utf8-holdback --only unbounded-queue
    python tools/break_it.py --stale    # only the rows whose edit changed since recorded
    python tools/break_it.py --try no-chunking   # an exercise: one row, its one test, seconds

Not part of the CI run; ``tests/test_break_it_docs.py`` checks instead, cheaply, that
every edit still applies to today's code exactly once, that the page quotes the table
the last run recorded, that each row was recorded from today's edit, and
that no row is one where nothing failed (such a row is a missing test: write it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "break-it.json"
PAGE = ROOT / "docs" / "break-it.md"
BEGIN, END = "<!-- break-it table: begin -->", "<!-- break-it table: end -->"
PER_TEST_TIMEOUT_S = 90  # a broken mechanism may hang a test; that is a failure too
# Enough to name the mechanism's guards. Counted per test path a row runs, not over the
# row: one overall cap spent itself inside the first file (row 3 once listed only
# test_scheduler.py's twelve and never reached the simulator or the property tests).
MAX_FAILURES = 12


@dataclass(frozen=True)
class Mutation:
    key: str  # a short stable name
    mechanism: str  # what is removed, in the reader's words
    path: str  # the file edited, relative to the project root
    old: str  # exact snippet, present exactly once
    new: str  # what replaces it
    tests: tuple[str, ...]  # the test paths run for this row

    def apply(self, root: Path) -> None:
        target = root / self.path
        text = target.read_text()
        count = text.count(self.old)
        if count != 1:
            raise ValueError(f"{self.key}: the snippet occurs {count} times in {self.path}")
        target.write_text(text.replace(self.old, self.new))


# The edits. Each `old` is copied from the code as it is; `tests/test_break_it_docs.py`
# fails as soon as one of them no longer matches, so this list cannot drift silently.
MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "blocking-dispatch",
        "non-blocking dispatch (the batch loop waits for a slow client)",
        "src/triollm/output.py",
        """        if request.send.statistics().current_buffer_used >= request.delta_room:
            self._too_slow(choice)
            return""",
        """        while request.send.statistics().current_buffer_used >= request.delta_room:
            __import__("time").sleep(0.001)  # broken: wait for room, holding everyone""",
        ("tests/test_service.py", "tests/server/test_slow_client.py", "tests/mechanisms"),
    ),
    Mutation(
        "unbounded-buffer",
        "the bounded per-request buffer",
        "src/triollm/output.py",
        "delta_room = n * self.stream_buffer_steps",
        'delta_room = float("inf")  # broken: no bound',
        ("tests/test_service.py", "tests/server/test_slow_client.py"),
    ),
    Mutation(
        "no-answer-reservation",
        "reserving the answer at admission (the prompt alone is taken, then a block at a time)",
        "src/triollm/policies.py",
        # Both halves, or the Scheduler's own guard refuses the policy ("must take at
        # least N blocks") and every failure is that guard, not the deadlock it prevents.
        """    grows: bool = False
    deterministic: bool = True
    orders_by_priority: bool = False  # set it when an answer reads SeqView.priority

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]:
        return blocks_for(seq.prompt_len + seq.max_tokens, view.block_size), 0
""",
        """    grows: bool = True  # broken: grow a block at a time, as the guard then allows
    deterministic: bool = True
    orders_by_priority: bool = False  # set it when an answer reads SeqView.priority

    def admission_blocks(self, seq: SeqView, view: SchedulerView) -> tuple[int, int]:
        return blocks_for(seq.n_tokens, view.block_size), 0  # broken: the prompt alone
""",
        ("tests/test_scheduler.py", "tests/test_sim.py", "tests/mechanisms", "property_tests"),
    ),
    Mutation(
        "disconnect-ignored",
        "stopping generation when the client leaves",
        "src/triollm/output.py",
        """        self._recv.close()
        cut = [self._output.abandon(c, reason, message) for c in self._members]
        return any(cut)""",
        """        self._recv.close()
        return False  # broken: the request generates on, to max_tokens""",
        (
            "tests/test_service.py",
            "tests/server/test_asgi.py",
            "tests/server/test_live_streaming.py",
            "tests/mechanisms",
        ),
    ),
    Mutation(
        "unbounded-queue",
        "the bounded admission queue",
        "src/triollm/admission.py",
        "        if len(self._waiters) + n > self.max_waiters:",
        "        if False:  # broken: every arrival waits",
        ("tests/test_admission.py", "tests/server/test_live_streaming.py", "tests/mechanisms"),
    ),
    Mutation(
        "timeout-is-a-cancel",
        "keeping 'timed out' (429) apart from 'client left' (499)",
        "src/triollm/admission.py",
        """            raise QueueTimeout(
                f"waited {self.wait_s:g} s for a slot without being admitted; retry later",
                retry_after(self.wait_s),
            )""",
        """            raise trio.Cancelled._create()  # broken: a timeout looks like a leave""",
        (
            "tests/test_admission.py",
            "tests/server/test_asgi.py",
            "tests/server/test_http_edges.py",
            "tests/mechanisms",
        ),
    ),
    Mutation(
        "missed-capacity-signal",
        "signalling capacity when a request ends",
        "src/triollm/service.py",
        """            self._to_remove.append(live.seq_id)
        self.queue.signal()""",
        """            self._to_remove.append(live.seq_id)""",
        (
            "tests/test_service.py",
            "tests/test_admission.py",
            "tests/server/test_live_streaming.py",
            "tests/mechanisms",
        ),
    ),
    Mutation(
        "one-admission-per-signal",
        "one driver admitting everyone who fits (a signal admits one, as an N-reader design does)",
        "src/triollm/scheduler.py",
        """                self._admit(head)
                admitted.append(head.seq_id)
                continue""",
        """                self._admit(head)
                admitted.append(head.seq_id)
                break  # broken: one admission per wake-up""",
        (
            "tests/test_scheduler.py",
            "tests/test_admission.py",
            "tests/test_service.py",
            "property_tests",
        ),
    ),
    Mutation(
        "decode-before-prefill",
        "prefill chunks before decode rows",
        "src/triollm/scheduler.py",
        """        for seq in order:
            if seq.state is SeqState.PREFILLING and left > 0:""",
        """        for seq in order:
            fresh = seq.seq_id not in rows and seq.seq_id not in blocked
            if seq.state is SeqState.DECODING and fresh and left > 0:
                rows[seq.seq_id] = 1  # broken: every decode row before any prefill
                left -= 1
        for seq in order:
            if seq.state is SeqState.PREFILLING and left > 0:""",
        ("tests/test_scheduler.py", "tests/test_sim.py", "property_tests"),
    ),
    Mutation(
        "no-chunking",
        "chunked prefill (a prompt is prefilled in one step)",
        "src/triollm/scheduler.py",
        "n = min(cfg.chunk_tokens, len(seq.token_ids) - self.kv.computed(seq.seq_id), left)",
        "n = min(len(seq.token_ids) - self.kv.computed(seq.seq_id), left)",
        ("tests/test_scheduler.py", "tests/test_offline.py", "tests/mechanisms", "property_tests"),
    ),
    Mutation(
        "no-utf8-holdback",
        "holding back an unfinished UTF-8 character",
        "src/triollm/model/tokenizer.py",
        """            or window.endswith(REPLACEMENT_CHAR)
            or self._ids[-1] in self._tok.byte_fallback_ids""",
        """            or False  # broken: send whatever decodes now""",
        ("tests/model/test_detok.py", "tests/test_textstream.py"),
    ),
    Mutation(
        "buffered-sse",
        "one flushed SSE event per token (the events are held until the end)",
        "src/triollm/server/responses.py",
        """        async for event in self.stream.events():
            if isinstance(event, Delta):
                lp = self._logprobs(event)""",
        """        held = [event async for event in self.stream.events()]  # broken
        for event in held:
            if isinstance(event, Delta):
                lp = self._logprobs(event)""",
        ("tests/server/test_live_streaming.py", "tests/server/test_asgi.py"),
    ),
    Mutation(
        "no-retry-after",
        "Retry-After on a 429",
        "src/triollm/server/app.py",
        """headers={"Retry-After": str(exc.retry_after_s)},""",
        """headers={},""",
        (
            "tests/server/test_live_streaming.py",
            "tests/server/test_http_edges.py",
            "tests/mechanisms",
        ),
    ),
    Mutation(
        "cancelled-blocks-kept",
        "freeing a cancelled sequence's blocks",
        "src/triollm/scheduler.py",
        """        if seq.state is SeqState.WAITING:
            self._waiting.remove((seq.ticket, seq.seq_id))
        else:
            self._release(seq)""",
        """        if seq.state is SeqState.WAITING:
            self._waiting.remove((seq.ticket, seq.seq_id))
        elif state is not SeqState.CANCELLED:  # broken: a cancel keeps its blocks
            self._release(seq)""",
        ("tests/test_scheduler.py", "tests/test_service.py", "property_tests"),
    ),
    Mutation(
        "batch-dependent-kernel",
        "batch invariance of the weight products (a row's sum depends on its batch)",
        "src/triollm/model/matmul.py",
        "            zero = ir.Constant(vf, [0.0] * _LANES)",
        "            zero = ir.Constant(vf, [1e-6 * (rows == 1)] * _LANES)  # broken",
        ("tests/model/test_matmul.py", "tests/model/test_batch.py"),
    ),
    Mutation(
        "preempt-the-oldest",
        "preempting the latest arrival (the oldest is evicted instead)",
        "src/triollm/policies.py",
        "        return max(running, key=lambda s: s.ticket).seq_id",
        "        return min(running, key=lambda s: s.ticket).seq_id",
        ("tests/test_scheduler.py", "property_tests"),
    ),
    Mutation(
        "one-choice-closed",
        "a request's end ending every one of its n choices (only the first is ended)",
        "src/triollm/output.py",
        "reason, message) for c in self._members]",
        "reason, message) for c in self._members[:1]]  # broken: the rest generate on",
        ("tests/test_service_choices.py", "tests/server/test_choices_http.py"),
    ),
)


# One test per row that fails when the row's edit is in: the exercise (`--try KEY`)
# runs only it, in seconds, where the row itself runs whole test files. Kept apart from
# the Mutations, whose digests would otherwise all change with it; each is one of its
# row's recorded failures (tests/test_break_it_docs.py checks).
PROOFS: dict[str, str] = {
    "blocking-dispatch": "tests/test_service.py::"
    "test_a_slow_reader_is_cut_off_and_its_neighbour_completes",
    "unbounded-buffer": "tests/test_service.py::"
    "test_a_slow_reader_is_cut_off_and_its_neighbour_completes",
    "no-answer-reservation": "tests/test_sim.py::"
    "test_in_the_seed_scenario_only_free_slot_deadlocks",
    "disconnect-ignored": "tests/test_service.py::"
    "test_a_client_leaving_mid_stream_returns_blocks_and_admits_the_next",
    "unbounded-queue": "tests/test_admission.py::"
    "test_arriving_to_a_full_queue_is_refused_at_once_with_retry_after",
    "timeout-is-a-cancel": "tests/test_admission.py::"
    "test_a_wait_past_the_budget_is_429_and_its_sequence_is_cancelled",
    "missed-capacity-signal": "tests/test_service.py::"
    "test_a_client_leaving_mid_stream_returns_blocks_and_admits_the_next",
    "one-admission-per-signal": "tests/test_admission.py::test_coalesced_signals_lose_nothing",
    "decode-before-prefill": "tests/test_scheduler.py::"
    "test_prefill_goes_before_decode_when_rows_are_scarce",
    "no-chunking": "tests/test_scheduler.py::"
    "test_the_prompt_is_chunked_and_only_the_final_chunk_samples",
    "no-utf8-holdback": "tests/model/test_detok.py::"
    "test_an_emoji_split_over_byte_tokens_is_held_back_until_complete",
    "buffered-sse": "tests/server/test_asgi.py::"
    "test_a_stream_longer_than_quart_response_timeout_is_not_cut",
    "no-retry-after": "tests/server/test_live_streaming.py::"
    "test_overload_gets_clean_429s_at_once_and_every_admitted_request_completes",
    "cancelled-blocks-kept": "tests/test_scheduler.py::"
    "test_cancelled_sequence_returns_its_blocks_before_next_plan[decoding]",
    "batch-dependent-kernel": "tests/model/test_matmul.py::"
    "test_a_row_gets_the_same_bits_alone_and_in_a_batch",
    "preempt-the-oldest": "tests/test_scheduler.py::"
    "test_preempt_evicts_the_latest_arrival_and_recomputes_its_tokens",
    "one-choice-closed": "tests/test_service_choices.py::"
    "test_closing_the_request_cancels_every_choice_and_frees_their_blocks_at_once",
}
TRY_TIMEOUT_S = 30  # a blocked dispatch hangs its test: that hang is the failure


def try_one(key: str) -> int:
    """The exercise: break one mechanism in a scratch copy and run its one test.

    Prints the edit and the test's verdict; records nothing. Returns 0 when the test
    failed (the mechanism is guarded), 1 when it passed (a missing test)."""
    m = next(m for m in MUTATIONS if m.key == key)
    proof = PROOFS[key]
    root = _fresh_scratch(SCRATCH_TRY)
    m.apply(root)
    print(f"broken: {m.mechanism}\n  in {m.path}: {_edit(m)}\n  running {proof}")
    started = time.monotonic()
    failing, summary = _pytest(root, [proof], maxfail=1, timeout_s=TRY_TIMEOUT_S)
    print(f"  {summary} ({time.monotonic() - started:.0f} s)")
    if failing:
        print("  the test failed: this mechanism is guarded. Undo nothing: it was a scratch copy.")
        return 0
    print("  the test PASSED with the mechanism removed: that is a missing test")
    return 1


def digest(m: Mutation) -> str:
    """A digest of one edit: a recorded result counts only for the edit it was made with."""
    blob = json.dumps(asdict(m), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _scratch_copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+?)(?: - |$)", re.M)


# Every row runs in the same scratch path, with numba's cache in one place outside it:
# numba finds a compiled kernel by its source file's path and stamp (`copy2` keeps the
# stamp), so only the first run compiles. Without this, every row compiled the kernels
# again inside the session fixture that loads a model, past the per-test timeout, and
# recorded that fixture's timeout as the mechanism's failure.
SCRATCH = Path(tempfile.gettempdir()) / "triollm-break-it"
NUMBA_CACHE = Path.home() / ".cache" / "triollm" / "break-it-numba"


def _env(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(root / "src"),
        "HYPOTHESIS_PROFILE": "ci",
        "NUMBA_CACHE_DIR": str(NUMBA_CACHE),
    }


# An exercise gets its own copy, so trying one row never pulls the scratch tree out
# from under a recording run (the first model-loading exercise compiles there once).
SCRATCH_TRY = Path(tempfile.gettempdir()) / "triollm-break-it-try"


def _fresh_scratch(scratch: Path = SCRATCH) -> Path:
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    _scratch_copy(scratch)
    return scratch


def warm_kernels() -> None:
    """Compile (or load) every kernel once in the unedited scratch copy, untimed."""
    root = _fresh_scratch()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from triollm.model.loader import load_model; "
            "load_model('tests/fixtures/models/llama-gqa-f32')",
        ],
        cwd=root,
        env=_env(root),
        check=True,
    )


def run_one(m: Mutation) -> dict[str, object]:
    root = _fresh_scratch()  # one copy per row, at the same path (see SCRATCH)
    m.apply(root)
    started = time.monotonic()
    failing: set[str] = set()
    summaries, capped = [], False
    for path in m.tests:  # one run per path: the cap is per path (see MAX_FAILURES)
        found, summary = _pytest(root, [path], maxfail=MAX_FAILURES)
        failing |= set(found)
        capped = capped or len(found) >= MAX_FAILURES
        summaries.append(f"{path}: {summary}")
    return {
        "digest": digest(m),
        "failing": sorted(failing),
        "capped": capped,
        "summary": "; ".join(summaries),
        "seconds": round(time.monotonic() - started),
    }


def _pytest(
    root: Path, targets: list[str], *, maxfail: int, timeout_s: int = PER_TEST_TIMEOUT_S
) -> tuple[list[str], str]:
    """Run pytest on ``targets`` in ``root``; (the failing node ids, its summary line)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfE",
            "--tb=no",
            "-p",
            "no:cacheprovider",
            f"--timeout={timeout_s}",
            f"--maxfail={maxfail}",
            *targets,
        ],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return sorted(set(_FAILED.findall(done.stdout))), summary


def render_table(results: dict[str, dict[str, object]]) -> str:
    """The table (what is removed, which tests fail), then the edits, row by row: the
    edits are long code, and a table cell would wrap them a few letters a line."""
    rows = [
        "| # | mechanism removed | tests that fail without it |",
        "| ---: | --- | --- |",
    ]
    edits = ["The edits, by row (`old` → `new`, shortened; then the tests run):", ""]
    for number, m in enumerate(MUTATIONS, 1):
        edits.append(
            f"{number}. `{m.path}`: {_edit(m)}; runs {', '.join(f'`{t}`' for t in m.tests)}"
        )
        r = results.get(m.key)
        if r is None or r.get("digest") != digest(m):
            rows.append(
                f"| {number} | {m.mechanism} | "
                "not recorded for this edit yet (`python tools/break_it.py --stale`) |"
            )
            continue
        failing = r["failing"]
        assert isinstance(failing, list)
        # Tests named as sentences first: they say what broke; state machines after.
        shown = sorted(failing, key=lambda t: (t.endswith("::runTest"), t))[:6]
        names = "<br>".join(f"`{_test_name(t)}`" for t in shown)
        more = f"<br>and {len(failing) - 6} more" if len(failing) > 6 else ""
        count = f"{len(failing)}+" if r.get("capped") else f"{len(failing)}"
        cell = f"**{count}**: {names}{more}" if failing else "**none: a missing test**"
        rows.append(f"| {number} | {m.mechanism} | {cell} |")
    return "\n".join([*rows, "", *edits])


def _test_name(node_id: str) -> str:
    """A test's name as the table shows it; a hypothesis state machine's only test is
    `runTest`, so it goes by its class (`TestReserve`, the machine under one policy)."""
    parts = node_id.split("::")
    return parts[-2] if parts[-1] == "runTest" and len(parts) > 2 else parts[-1]


def _one_line(snippet: str, skip: int = 0) -> str:
    text = " ".join(snippet.split())
    if skip:
        text = "… " + text[skip:]
    return (text[:70] + " …") if len(text) > 72 else text.replace("|", "\\|")


def _edit(m: Mutation) -> str:
    """`old` → `new`, one line each; when they open alike, both start a little before
    where they differ, so the shortened forms still show the change."""
    old, new = (" ".join(t.split()) for t in (m.old, m.new))
    same = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), 0)
    skip = old.rfind(" ", 0, same - 10) + 1 if same > 40 else 0  # from a word's start
    return f"`{_one_line(m.old, skip)}` → `{_one_line(m.new, skip)}`"


def write_page(results: dict[str, dict[str, object]]) -> None:
    page = PAGE.read_text()
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{render_table(results)}\n{END}{tail}")


def _write_results(results: dict[str, dict[str, object]]) -> None:
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="KEY", help="run only this row")
    parser.add_argument(
        "--stale", action="store_true", help="run only rows not recorded from today's edit"
    )
    parser.add_argument(
        "--try",
        dest="exercise",
        metavar="KEY",
        help="an exercise: break this row's mechanism and run its one test (seconds); "
        "records nothing (docs/exercises.md)",
    )
    args = parser.parse_args(argv)
    known = {m.key for m in MUTATIONS}
    unknown = set(args.only or ()) - known
    if args.exercise is not None and args.exercise not in known:
        unknown.add(args.exercise)
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}; known: {sorted(known)}")
    if args.exercise is not None:
        return try_one(args.exercise)
    results: dict[str, dict[str, object]] = (
        json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    )
    warm_kernels()
    for m in MUTATIONS:
        if args.only and m.key not in args.only:
            continue
        if args.stale and results.get(m.key, {}).get("digest") == digest(m):
            continue
        r = run_one(m)
        results[m.key] = r
        print(f"{m.key:<24} {len(r['failing']):>3} failing  ({r['seconds']} s)  {r['summary']}")
        _write_results(results)  # after every row: an interrupted run keeps what it did
    results = {m.key: results[m.key] for m in MUTATIONS if m.key in results}
    _write_results(results)
    write_page(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
