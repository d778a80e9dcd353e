"""Turn a state machine's counter-example into a ``triollm simulate`` scenario.

The machine logs what it did in the simulator's terms (``SchedulerMachine.log``):
arrivals, cancellations, EOS and each turn's plan, with the turn they happened
before. The simulator's clock is the same: at step ``t`` the requests arriving at
``t`` come in, the queue admits, the Scheduler plans, and the plan is committed.
The machine may also step without admitting (the scenario says so:
``skip_admission``) and admit without a step, which the simulator never does; so
the scenario is replayed through the simulator and written only if every step's
rows come out exactly as the machine saw them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from triollm.policies import SchedulingPolicy
from triollm.sim.runner import Run, simulate
from triollm.sim.scenario import parse_scenario


def scenario_of(log: list[tuple[Any, ...]]) -> dict[str, Any]:
    """The scenario (as JSON-able data) that re-enacts ``log``."""
    config = next(e[1] for e in log if e[0] == "config")
    requests: dict[int, dict[str, Any]] = {}
    for e in log:
        if e[0] == "arrive":
            _, turn, seq, prompt, max_tokens, priority = e
            r = {"name": f"s{seq}", "arrival": turn, "prompt": prompt, "answer": max_tokens}
            if priority:
                r["priority"] = priority
            r["max_tokens"] = max_tokens
            requests[seq] = r
        elif e[0] == "eos":
            _, seq, generated = e
            requests[seq]["answer"] = generated
        elif e[0] in ("cancel", "cancel_mid"):
            _, turn, seq = e
            # A cancel that lands mid-step is seen by the next one (the simulator cannot
            # cancel between plan and commit; the comparison below tells if that mattered).
            requests[seq].setdefault("cancel", turn + (e[0] == "cancel_mid"))
    for r in requests.values():
        if r["answer"] == r["max_tokens"]:
            del r["max_tokens"]
    skipped = [e[1] for e in log if e[0] == "skip_admission"]
    extra = {"skip_admission": skipped} if skipped else {}
    return {**config, **extra, "requests": [requests[s] for s in sorted(requests)]}


def replays(log: list[tuple[Any, ...]], run: Run) -> bool:
    """Did the simulator plan, turn by turn, exactly the rows the machine planned?"""
    planned = [e for e in log if e[0] == "plan"]
    if len(run.steps) < len(planned):
        return False
    for (_, turn, rows), step in zip(planned, run.steps, strict=False):
        seen = tuple((int(r.request[1:]), r.kind == "prefill", r.start, r.rows) for r in step.rows)
        if step.t != turn or seen != rows:
            return False
    return True


def write_replay(
    log: list[tuple[Any, ...]], policy: SchedulingPolicy, spec: str, target: Path, step: int
) -> str:
    """Write the scenario to ``target`` if it replays exactly; say what happened."""
    data = scenario_of(log)
    if not data["requests"]:
        return "(no replay written: the counter-example needs no request at all)"
    scenario = parse_scenario(data, str(target))
    try:
        run = simulate(scenario, policy)
    except RuntimeError as exc:  # a policy that never lets the run end
        return f"(no replay written: the simulator could not finish the scenario: {exc})"
    if not replays(log, run):
        return (
            "(no replay written: this counter-example runs an admission pass between two "
            "steps while requests arrive, which the simulator's loop never does)"
        )
    target.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    html = target.with_suffix(".html")
    return (
        f"wrote {target}: it replays this counter-example step for step. To watch it:\n"
        f"  triollm simulate {target} --policy {spec} --html {html}\n"
        f"  then open {html}?step={step}"
    )
