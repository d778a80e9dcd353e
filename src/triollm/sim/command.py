"""``triollm simulate``: replay a batching scenario under each scheduling policy.

With no scenario file it replays the seed's figure (20.3.2): 4 slots sharing a
paged pool, 7 requests, blocks of 4 positions, chunks of 8 tokens, 12 rows a step.
It prints a table per policy and a comparison; ``--html FILE`` also writes a
self-contained page that steps through every policy side by side.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from triollm.errors import UserError
from triollm.policies import load_policy
from triollm.scheduler import Policy
from triollm.sim.report import format_comparison, format_run
from triollm.sim.runner import simulate
from triollm.sim.scenario import load_scenario, seed_scenario


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario",
        nargs="?",
        help="a scenario file (.json or .toml); default: the seed's seven requests",
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="POLICY",
        help="simulate only this policy (repeatable): a built-in name "
        f"({', '.join(p.value for p in Policy)}), module:Name or file.py:Name; default: "
        "the four built-ins",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        metavar="N",
        help="the shared-prefix variant: every prompt opens with the same N tokens "
        "and the prefix cache is on (docs/prefix-cache.md)",
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained page that steps through the runs",
    )


def run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario) if args.scenario else seed_scenario()
    if args.shared_prefix is not None:
        if args.shared_prefix < 1:
            raise UserError(f"--shared-prefix must be >= 1, got {args.shared_prefix}")
        scenario = replace(scenario, shared_prefix=args.shared_prefix, prefix_cache=True)
    try:
        policies = [load_policy(p) for p in args.policy] if args.policy else list(Policy)
    except ValueError as exc:
        raise UserError(f"--policy: {exc}") from None
    runs = [simulate(scenario, p) for p in policies]
    print(
        f"scenario {scenario.source}: {scenario.slots} slots, {scenario.num_blocks} blocks of "
        f"{scenario.block_size} positions, prefill chunks of {scenario.chunk_tokens}, "
        f"{scenario.step_rows} rows a step, {len(scenario.requests)} requests "
        "(times in steps from arrival)"
    )
    for r in runs:
        print()
        print(format_run(r))
    if len(runs) > 1:
        print()
        print(format_comparison(runs))
    if args.html:
        from triollm.sim.page import render_page

        out = Path(args.html)
        try:
            out.write_text(render_page(runs), encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{out}: cannot write the page ({exc.strerror})") from None
        print(f"\nwrote {out}")
    return 0
