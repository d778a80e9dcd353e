"""Text tables for ``triollm simulate``: one per policy, then a comparison."""

from __future__ import annotations

from triollm.sim.runner import Run


def _cell(v: int | None) -> str:
    return "-" if v is None else str(v)


def mean_ttft(run: Run) -> float | None:
    ttfts = [o.ttft for o in run.outcomes if o.ttft is not None]
    return sum(ttfts) / len(ttfts) if ttfts else None


def max_ttft(run: Run) -> int | None:
    ttfts = [o.ttft for o in run.outcomes if o.ttft is not None]
    return max(ttfts) if ttfts else None


def format_run(run: Run) -> str:
    """The per-request table of one policy, its totals, and its deadlock if any."""
    lines = [f"== {run.policy_name}: {run.description} =="]
    header = ("request", "arrives", "prompt", "answer", "admitted", "TTFT", "done in", "preempted")
    rows = [header]
    for o in run.outcomes:
        admitted = "refused" if o.refused else _cell(o.admitted)
        rows.append(
            (
                o.name,
                str(o.arrival),
                str(o.prompt),
                str(o.answer),
                admitted,
                _cell(o.ttft),
                _cell(o.completion),
                str(o.preemptions),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    mean = mean_ttft(run)
    totals = (
        f"{'deadlocked after' if run.deadlock else 'all done after'} {run.total_steps} steps; "
        f"TTFT mean {'-' if mean is None else f'{mean:.1f}'}, max {_cell(max_ttft(run))}; "
        f"pool {run.utilisation:.0%} held on average "
        f"({run.written_fraction:.0%} of held positions written); "
        f"{run.preemptions} preemption(s)"
    )
    lines.append(totals)
    sc = run.scenario
    if sc.prefix_cache:
        prompts = sum(o.prompt for o in run.outcomes if not o.refused)
        found = sum(o.cached_tokens for o in run.outcomes)
        lines.append(
            f"prefix cache on, every prompt opening with the same {sc.shared_prefix} tokens: "
            f"{found} of {prompts} prompt tokens found cached at admission ("
            + ", ".join(f"{o.name} {o.cached_tokens}" for o in run.outcomes if o.cached_tokens)
            + ")"
        )
    if run.deadlock is not None:
        stuck = ", ".join(o.name for o in run.outcomes if o.done is None and not o.refused)
        lines.append(f"DEADLOCK at step {run.deadlock.t}: {run.deadlock.description}")
        lines.append(f"  never finish: {stuck}; nothing running can free a block")
    for o in run.outcomes:
        if o.refused:
            lines.append(f"  {o.name} refused at the door: {o.refused}")
    return "\n".join(lines)


def format_comparison(runs: list[Run]) -> str:
    """One line per policy: steps, TTFT, pool use, preemptions, outcome."""
    header = ("policy", "steps", "mean TTFT", "max TTFT", "pool held", "preemptions", "outcome")
    rows = [header]
    for run in runs:
        mean = mean_ttft(run)
        outcome = f"DEADLOCK at step {run.deadlock.t}" if run.deadlock else "all finished"
        rows.append(
            (
                run.policy_name,
                str(run.total_steps),
                "-" if mean is None else f"{mean:.1f}",
                _cell(max_ttft(run)),
                f"{run.utilisation:.0%}",
                str(run.preemptions),
                outcome,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in (0, 6) else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    )
