"""``triollm check-policy SPEC``: prove a scheduling policy's claims, or break one.

Runs the hypothesis state machine (``triollm.check.machine``) against the policy:
random pools, slots, chunks and row budgets; arrivals, admission passes, steps,
EOS at random, cancellations in any state. It checks exactly the claims the
policy declares (plus any ``--claim``), says which it did not check, and on a
violation prints the shrunk counter-example as a step-by-step trace; for a
deterministic policy it also writes a ``triollm simulate`` scenario that replays
it (when the replay is exact). Exit status: 0 all claims held, 1 a claim broke.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triollm.errors import UserError
from triollm.policies import Claim, SchedulingPolicy, load_policy

DEFAULT_EXAMPLES = 200  # ~10-40 s for a built-in on a loaded 2-core machine
DEFAULT_STEPS = 40  # rules per example, as the property tests' ci profile
DEFAULT_TIME_LIMIT_S = 120.0
DEFAULT_SHRINK_TIME_S = 120.0
_BATCH = 25  # examples per hypothesis run; the time limit is checked between runs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "policy",
        metavar="POLICY",
        help="a built-in name (reserve, static, free-slot, preempt), module:Name or file.py:Name",
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=DEFAULT_EXAMPLES,
        help=f"state-machine runs to try ({DEFAULT_EXAMPLES})",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"rules per run ({DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="search seed (0; same seed, same search)"
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        metavar="SECONDS",
        help=f"stop searching after this long ({DEFAULT_TIME_LIMIT_S:g} s; shrinking a "
        "counter-example may take longer)",
    )
    parser.add_argument(
        "--shrink-time",
        type=float,
        default=DEFAULT_SHRINK_TIME_S,
        metavar="SECONDS",
        help=f"stop shrinking a counter-example after this long ({DEFAULT_SHRINK_TIME_S:g} s; "
        "a less shrunk one is longer, not wrong)",
    )
    parser.add_argument(
        "--no-shrink",
        action="store_true",
        help="report the first counter-example as found (fast, deterministic, long)",
    )
    parser.add_argument(
        "--claim",
        action="append",
        default=[],
        choices=[c.value for c in Claim],
        help="also check a claim the policy does not make (repeatable)",
    )
    parser.add_argument(
        "--no-cancel",
        action="store_true",
        help="leave cancellations and stop strings out (they can only unblock a deadlock)",
    )
    parser.add_argument(
        "--replay",
        metavar="FILE",
        help="where to write the simulate scenario of a counter-example (default: "
        "check-policy-<name>.json in the current directory)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")


@dataclass
class Outcome:
    """What a search found."""

    examples: int = 0  # what hypothesis was asked for, batch by batch
    runs: int = 0  # machine instances (a few more: hypothesis replays and discards some)
    seconds: float = 0.0
    violated: Claim | None = None
    error: str | None = None  # the first line of what broke
    kind: str = ""  # "claim", "interface" (PolicyError), "scheduler", "policy raised"
    trace: list[str] = field(default_factory=list)
    log: list[tuple[Any, ...]] = field(default_factory=list)
    step: int = 0  # the simulator's step at which the claim broke
    found_s: float | None = None  # when the first failing run was seen (then: shrinking)
    timed_out: bool = False


def search(
    policy: SchedulingPolicy,
    claims: frozenset[Claim],
    *,
    examples: int,
    steps: int,
    seed: int,
    time_limit_s: float,
    ends_early: bool = True,
    shrink_time_s: float = DEFAULT_SHRINK_TIME_S,
    shrink: bool = True,
    progress: Any = None,
) -> Outcome:
    """Run the machine in batches of ``_BATCH`` examples until one fails, ``examples``
    have run, or ``time_limit_s`` has passed (checked between batches)."""
    from hypothesis import HealthCheck, Phase, reporting, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.internal.conjecture import engine, providers
    from hypothesis.stateful import get_state_machine_test

    from triollm.check.machine import ClaimViolated, machine_for
    from triollm.policies import PolicyError

    outcome = Outcome()
    base = machine_for(policy, claims, ends_early=ends_early)
    instances: list[Any] = []

    class Counted(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__()
            instances[:] = [self]  # the last run is the shrunk counter-example's replay
            outcome.runs += 1
            if progress is not None:
                progress(outcome.examples + 1, time.monotonic() - start, outcome.found_s)

        def check(self, claim: Claim, holds: bool, message: str) -> None:
            if not holds and claim in self.claims and outcome.found_s is None:
                outcome.found_s = time.monotonic() - start
            super().check(claim, holds, message)

    start = time.monotonic()
    batch = 0
    # Hypothesis bounds shrinking by a module constant (5 minutes); lend it ours.
    shrink_limit = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    # Hazard: hypothesis also draws constants it finds in whatever local modules are
    # loaded, so the same --seed would search differently in another process (the
    # docs test found that). A seed must name one search: no local constants.
    local_constants = getattr(providers, "_get_local_constants", None)
    no_constants = getattr(providers, "Constants", None)
    while outcome.examples < examples:
        if time.monotonic() - start > time_limit_s:
            outcome.timed_out = True
            break
        n = min(_BATCH, examples - outcome.examples)
        run_settings = settings(
            max_examples=n,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            report_multiple_bugs=False,
            phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])],
            suppress_health_check=list(HealthCheck),
        )
        test = get_state_machine_test(Counted, settings=run_settings)
        test = hypothesis_seed(seed * 1_000_003 + batch)(test)
        batch += 1
        try:
            if shrink_limit is not None:
                engine.MAX_SHRINKING_SECONDS = shrink_time_s  # type: ignore[assignment]
            if local_constants is not None and no_constants is not None:
                providers._get_local_constants = no_constants
            with reporting.with_reporter(lambda _msg: None):
                test()
        except ClaimViolated as exc:
            outcome.violated, outcome.kind = exc.claim, "claim"
            outcome.error = str(exc)
        except PolicyError as exc:
            outcome.kind, outcome.error = "interface", str(exc)
        except AssertionError as exc:
            outcome.kind, outcome.error = "scheduler", f"a Scheduler contract broke: {exc!r}"
        except Exception as exc:
            outcome.kind, outcome.error = "policy raised", f"{type(exc).__name__}: {exc}"
        finally:
            if shrink_limit is not None:
                engine.MAX_SHRINKING_SECONDS = shrink_limit
            if local_constants is not None:
                providers._get_local_constants = local_constants
        if outcome.error is not None:
            machine = instances[0]
            outcome.trace, outcome.log = list(machine.trace), list(machine.log)
            outcome.step = machine.now
            break
        outcome.examples += n
    outcome.seconds = time.monotonic() - start
    return outcome


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for name, value, least in (("--examples", args.examples, 1), ("--steps", args.steps, 1)):
        if value < least:
            raise UserError(f"{name} must be >= {least}, got {value}")
    for name, seconds in (("--time-limit", args.time_limit), ("--shrink-time", args.shrink_time)):
        if seconds <= 0:
            raise UserError(f"{name} must be > 0 seconds, got {seconds:g}")
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise UserError(
            "check-policy runs a hypothesis state machine, and hypothesis is not installed: "
            "pip install 'triollm[check]' (or the dev extra)"
        ) from None
    claims = frozenset(policy.claims) | {Claim(c) for c in args.claim}
    print(f"policy {policy.name}: {policy.description}")
    checked = [c for c in Claim if c in claims]
    width = max(len(c.value) for c in Claim)
    print(f"checking {len(checked)} claim(s):")
    for c in checked:
        added = " (added by --claim)" if c not in policy.claims else ""
        print(f"  {c.value.ljust(width)}  {c.meaning}{added}")
    unchecked = [c.value for c in Claim if c not in claims]
    if unchecked:
        print(f"not checked (the policy does not claim them): {', '.join(unchecked)}")
    tty = sys.stderr.isatty()
    last = [0.0]

    def progress(n: int, seconds: float, found_s: float | None) -> None:
        if args.quiet or (not tty and seconds - last[0] < 10):
            return
        last[0] = seconds
        end = "\r" if tty else "\n"
        line = f"  searching: {n}/{args.examples} examples, {seconds:.0f} s"
        if found_s is not None:
            line = f"  found a counter-example at {found_s:.0f} s; shrinking it: {seconds:.0f} s"
        print(line, end=end, file=sys.stderr)

    out = search(
        policy,
        claims,
        examples=args.examples,
        steps=args.steps,
        seed=args.seed,
        time_limit_s=args.time_limit,
        ends_early=not args.no_cancel,
        shrink_time_s=args.shrink_time,
        shrink=not args.no_shrink,
        progress=progress,
    )
    if tty and not args.quiet:
        print(" " * 60, end="\r", file=sys.stderr)
    searched = (
        f"{out.runs} run(s) of up to {args.steps} rules in {out.seconds:.1f} s (seed {args.seed})"
    )
    if out.error is None:
        stop = f", stopped at the {args.time_limit:g} s time limit" if out.timed_out else ""
        print(f"held: all {len(checked)} claim(s), over {searched}{stop}")
        return 0
    if out.found_s is not None and not args.no_shrink:
        searched += f"; found at {out.found_s:.1f} s, the rest is shrinking"
    headline = {
        "claim": "VIOLATED",
        "interface": "THE POLICY ANSWERED OUTSIDE THE INTERFACE",
        "policy raised": "THE POLICY RAISED",
        "scheduler": "A SCHEDULER CONTRACT BROKE (a triollm bug: please report it)",
    }[out.kind]
    print(f"{headline} after {searched}:")
    print(f"  {out.error}")
    rest = [c.value for c in checked if c is not out.violated]
    if rest:
        print(f"  not established (the search stops at the first violation): {', '.join(rest)}")
    print(f"\nthe {'' if args.no_shrink else 'shrunk '}counter-example, step by step:")
    for line in out.trace:
        print(f"  {line}")
    if out.kind != "claim":
        return 1
    if policy.deterministic:
        from triollm.check.replay import write_replay

        target = Path(args.replay or f"check-policy-{policy.name}.json")
        print()
        print(write_replay(out.log, policy, args.policy, target, out.step))
    else:
        print("\n(the policy says it is not deterministic: no replay scenario written)")
    return 1
