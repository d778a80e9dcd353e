"""The ``--html`` page: one self-contained file that steps through every run.

The template (``page.html`` beside this file) holds the CSS and the small script;
this module only serialises the runs into it. Nothing on the page fetches anything:
it works from a file:// URL with the network off.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from triollm.sim.palette import FREE, PALETTE
from triollm.sim.report import max_ttft, mean_ttft
from triollm.sim.runner import Run, SimStep

_MARK = "/*__DATA__*/null"


def page_data(runs: list[Run]) -> dict[str, Any]:
    """Everything the page script reads, as plain JSON-able values."""
    sc = runs[0].scenario
    return {
        "palette": list(PALETTE),
        "free": FREE,
        "scenario": {
            "slots": sc.slots,
            "num_blocks": sc.num_blocks,
            "block_size": sc.block_size,
            "chunk_tokens": sc.chunk_tokens,
            "step_rows": sc.step_rows,
            "source": sc.source,
            "prefix_cache": sc.prefix_cache,
            "shared_prefix": sc.shared_prefix,
            "requests": [
                {"name": r.name, "arrival": r.arrival, "prompt": r.prompt, "answer": r.answer}
                for r in sc.requests
            ],
        },
        "runs": [
            {
                "policy": run.policy_name,
                "description": run.description,
                "deadlock": None
                if run.deadlock is None
                else {"t": run.deadlock.t, "description": run.deadlock.description},
                "mean_ttft": mean_ttft(run),
                "max_ttft": max_ttft(run),
                "utilisation": run.utilisation,
                "preemptions": run.preemptions,
                "outcomes": [
                    {
                        "name": o.name,
                        "arrival": o.arrival,
                        "prompt": o.prompt,
                        "answer": o.answer,
                        "first_token": o.first_token,
                        "done": o.done,
                        "refused": o.refused,
                    }
                    for o in run.outcomes
                ],
                "steps": [_step(s) for s in run.steps],
                "end": end_state(run),
            }
            for run in runs
        ],
    }


def _step(s: SimStep) -> dict[str, Any]:
    return {
        "t": s.t,
        "rows": [[r.request, r.kind, r.start, r.rows] for r in s.rows],
        "slots": list(s.slots),
        "blocks": list(s.blocks),
        "shared": list(s.shared),
        "cached": list(s.cached),
        "waiting": list(s.waiting),
        "events": list(s.events),
        "tables": [[name, list(blocks), written] for name, blocks, written in s.tables],
    }


def end_state(run: Run) -> dict[str, Any]:
    """What the page shows once the slider is past this run's last step (the runs of
    one page end at different steps).

    A deadlocked run stays as it deadlocked: nothing more can happen, and the pool
    beside the red box must still be the full one it describes. A finished run shows
    what its last commit left: every slot empty, every block free (or kept by the
    prefix cache). Trap: the last *recorded* step is not that state; it was recorded
    before its commit, with the last request still in its slot."""
    if run.deadlock is not None:
        return _step(run.steps[-1])
    sc = run.scenario
    return {
        "t": len(run.steps),
        "rows": [],
        "slots": [None] * sc.slots,
        "blocks": [None] * sc.num_blocks,
        "shared": [],
        "cached": list(run.final_cached),
        "waiting": [],
        "events": ["all done"],
        "tables": [],
    }


def render_page(runs: list[Run]) -> str:
    """The whole page as a string, ready to write to a file."""
    template = resources.files("triollm.sim").joinpath("page.html").read_text("utf-8")
    if template.count(_MARK) != 1:
        raise RuntimeError("page.html must contain the data marker exactly once")
    # "</" inside a string would end the <script> element early (a request named
    # "</script>" in a user's scenario): escape it the way JSON allows.
    data = json.dumps(page_data(runs), separators=(",", ":")).replace("</", "<\\/")
    return template.replace(_MARK, data)
