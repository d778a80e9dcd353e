"""Where a served token's time goes: the engine's step against everything around it.

    python bench/bench_serverpath.py MODEL [--concurrency 1,8] [--requests 8]

``MODEL`` is a GGUF file or a model directory. Two measurements on the same file:

1. **engine**: ``bench_gguf.decode_case`` at batch 1 -- the forward pass alone, in
   process, as the side-by-side's ``decode b=1`` row measures it;
2. **server**: the real stack (``server/command.build_stack``, hypercorn on a free
   loopback port, ``serve_stack``'s warm-up) in this process, loaded by
   ``triollm bench serve`` in a child process (the side-by-side's client and
   workload: 32-token prompts of random ids, 32 tokens each, greedy, ignore_eos),
   one child per concurrency level.

While the server runs, the batch loop's seams are timed from the outside (nothing in
the package changes for it): the step runner as the loop calls it, ``Batch.run``
and ``LlamaModel.forward`` inside the worker thread, and the loop's own calls
(``plan_step``, ``commit``, ``dispatch``). Per decode step that gives

- ``forward``: the model's forward pass (in the worker);
- ``run extra``: the rest of ``Batch.run`` (the plan's check, sampling);
- ``hop in``: from the loop calling the runner to ``Batch.run`` starting in the worker;
- ``hop back``: from ``Batch.run`` returning to the loop resuming;
- ``commit``, ``dispatch``, ``plan``: the loop's own calls;
- ``between``: the rest of the loop's turn: the recorder, the metrics hooks, and
  whatever other task (an SSE handler writing its event) runs before the next
  step is launched;
- ``cycle``: one launch to the next: the step's period, what a client's ITL is;
- ``gap``: ``cycle - forward`` step by step: the server path's cost per step.

The engine's own b=1 step
beside it shows how much the server's forward pass itself is slowed by sharing the
2 cores with the event loop (and the load client). It also reports the client's
TPOT and ITL beside the step's cycle, the SSE writes' own gaps as the app hands
them to hypercorn (a client TPOT above those is between the socket and the
client), and the CPU time per token of the event loop thread and of the other
threads (``/proc/self/task``) and of the load client process (``getrusage``): on
a busy machine wall times swing 3-4x within seconds, CPU time much less.

Figures vary with the machine's load (print ``/proc/loadavg`` with them); for an
A/B run it once per tree, alternating, with ``PYTHONPATH`` naming the tree.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass
class Step:
    """One step's timestamps (``time.perf_counter`` seconds; 0.0: not seen)."""

    rows: int = 0
    decode_only: bool = False
    prefill_rows: int = 0
    decode_rows: int = 0
    sampled: tuple[int, ...] = ()  # the seq_ids that got a token from this step
    launched: float = 0.0  # the loop called the step runner
    run_start: float = 0.0  # Batch.run began in the worker
    run_end: float = 0.0
    forward: float = 0.0  # seconds of LlamaModel.forward inside it
    resumed: float = 0.0  # the runner returned to the loop
    commit: float = 0.0  # seconds
    dispatch: float = 0.0
    plan: float = 0.0  # seconds of the plan_step that made the *next* step


@dataclass
class Timeline:
    """The steps seen while recording; installed on a built stack by :func:`instrument`."""

    steps: list[Step] = field(default_factory=list)
    submits: list[float] = field(default_factory=list)  # when each request reached submit
    # (reached submit, its first seq_id) per request, once submit returned (admitted)
    admitted: list[tuple[float, int]] = field(default_factory=list)
    # Per HTTP request: [reached the app, first body bytes handed to hypercorn]
    requests: list[list[float]] = field(default_factory=list)
    # Per HTTP request: when each non-empty body message was handed to hypercorn
    writes: list[list[float]] = field(default_factory=list)
    recording: bool = False
    _current: Step | None = None

    def begin(self) -> None:
        self.steps, self.submits, self.requests, self.admitted = [], [], [], []
        self.writes = []
        self.recording, self._current = True, None

    def end(self) -> list[Step]:
        self.recording = False
        return self.steps


def instrument(service: Any, batch: Any, timeline: Timeline) -> None:
    """Wrap the seams of a built service (instance attributes; the classes are untouched)."""
    clock = time.perf_counter
    runner = service.step_runner
    run = batch.run
    forward = batch.model.forward
    commit = service.scheduler.commit
    dispatch = service.output.dispatch
    plan_step = service.scheduler.plan_step
    submit = service.submit_prompts
    local = threading.local()

    async def timed_runner(plan: Any) -> Any:
        step = Step(
            rows=plan.n_rows,
            decode_only=not any(c.prefill for c in plan.chunks),
            prefill_rows=sum(len(c.token_ids) for c in plan.chunks if c.prefill),
            decode_rows=sum(1 for c in plan.chunks if not c.prefill),
            sampled=tuple(c.seq_id for c in plan.chunks if c.sample),
        )
        timeline._current = step
        if timeline.recording:
            timeline.steps.append(step)
        step.launched = clock()
        try:
            return await runner(plan)
        finally:
            step.resumed = clock()

    def timed_run(plan: Any) -> Any:
        step = timeline._current
        local.forward = 0.0
        t0 = clock()
        try:
            return run(plan)
        finally:
            if step is not None:
                step.run_start, step.run_end, step.forward = t0, clock(), local.forward

    def timed_forward(*args: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return forward(*args, **kw)
        finally:
            local.forward = getattr(local, "forward", 0.0) + clock() - t0

    def timed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kw)
            finally:
                step = timeline._current
                if step is not None:
                    setattr(step, name, getattr(step, name) + clock() - t0)

        return wrapper

    async def timed_submit(*args: Any, **kw: Any) -> Any:
        t = clock()
        if timeline.recording:
            timeline.submits.append(t)
        stream = await submit(*args, **kw)
        if timeline.recording:
            timeline.admitted.append((t, stream.seq_id))
        return stream

    service.step_runner = timed_runner
    service.submit_prompts = timed_submit
    batch.run = timed_run
    batch.model.forward = timed_forward
    service.scheduler.commit = timed(commit, "commit")
    service.output.dispatch = timed(dispatch, "dispatch")
    service.scheduler.plan_step = timed(plan_step, "plan")


def instrument_app(stack: Any, timeline: Timeline) -> None:
    """Time each completions request from the app's entry to its first body bytes."""
    make_app = stack.make_app

    def make(nursery: Any) -> Any:
        life = make_app(nursery)
        inner = life.app

        async def timed_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            # Completions only: the client also POSTs /tokenize (its prompts of words,
            # triollm.bench.client.word_ids), which starts no generation to pair with.
            if (
                scope["type"] != "http"
                or scope["method"] != "POST"
                or scope["path"] != "/v1/completions"
                or not timeline.recording
            ):
                await inner(scope, receive, send)
                return
            rec = [time.perf_counter(), 0.0]
            timeline.requests.append(rec)
            writes: list[float] = []
            timeline.writes.append(writes)

            async def timed_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body" and message.get("body"):
                    writes.append(time.perf_counter())
                    rec[1] = rec[1] or writes[0]
                await send(message)

            await inner(scope, receive, timed_send)

        life.app = timed_app
        return life

    stack.make_app = make


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{1e3 * statistics.median(values):.2f} (mean {1e3 * statistics.fmean(values):.2f})"


def breakdown(steps: list[Step]) -> dict[str, list[float]]:
    """Per decode step: the parts named in the module docstring (seconds)."""
    parts: dict[str, list[float]] = {
        k: []
        for k in (
            "cycle",
            "forward",
            "run extra",
            "hop in",
            "hop back",
            "commit",
            "dispatch",
            "plan",
            "between",
            "gap",
        )
    }
    for a, b in itertools.pairwise(steps):
        if not (a.decode_only and b.decode_only and a.run_start and b.launched):
            continue
        cycle = b.launched - a.launched
        if cycle > 10 * (a.run_end - a.run_start) + 0.05:
            continue  # the loop parked on an empty plan in between (a request boundary)
        parts["cycle"].append(cycle)
        parts["forward"].append(a.forward)
        parts["run extra"].append(a.run_end - a.run_start - a.forward)
        parts["hop in"].append(a.run_start - a.launched)
        parts["hop back"].append(a.resumed - a.run_end)
        parts["commit"].append(a.commit)
        parts["dispatch"].append(a.dispatch)
        parts["plan"].append(a.plan)
        own = a.commit + a.dispatch + a.plan
        parts["between"].append(b.launched - a.resumed - own)
        parts["gap"].append(cycle - a.forward)  # everything but the forward pass
    return parts


def print_timeline(steps: list[Step]) -> None:
    """One line per step: its rows, its wall time, and the longest gap it ended for a
    stream that already had a token (what that stream's client sees as one ITL)."""
    if not steps or not steps[0].launched:
        return
    t0 = steps[0].launched
    last: dict[int, float] = {}  # seq_id -> when its previous token's step resumed
    print("timeline: step, launched +ms, prefill rows, decode rows, step ms, longest ITL ms ended")
    for i, s in enumerate(steps):
        gaps = [s.resumed - last[q] for q in s.sampled if q in last]
        for q in s.sampled:
            last[q] = s.resumed
        print(
            f"  {i:3d} {1e3 * (s.launched - t0):8.0f} {s.prefill_rows:4d} {s.decode_rows:3d} "
            f"{1e3 * (s.resumed - s.launched):7.0f} "
            f"{'-' if not gaps else f'{1e3 * max(gaps):7.0f}'}"
        )


def engine_step_s(model: Any, prompt: int, new: int, rounds: int) -> list[float]:
    from bench_gguf import decode_case

    return [decode_case(model, 1, prompt, new) / new for _ in range(rounds)]


def run_client(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "triollm.cli", "bench", "serve", "--url", url,
        "--concurrency", str(concurrency), "--requests", str(args.requests),
        "--prompt-tokens", str(args.prompt), "--max-tokens", str(args.new),
        "--warmup", "1", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    lines = out.read_text().splitlines() if out.exists() else []
    return json.loads(lines[-1]) if lines else {}


async def serve_and_load(stack: Any, batch: Any, args: argparse.Namespace) -> None:
    from triollm.server.command import serve_stack
    from triollm.server.frontend import HttpConfig

    timeline = Timeline()
    instrument(stack.service, batch, timeline)
    instrument_app(stack, timeline)
    shutdown = trio.Event()
    loop_tid = threading.get_native_id()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve_stack, stack, HttpConfig(host="127.0.0.1", port=0), shutdown)
        )
        url = binds[0]
        tmp = Path(tempfile.mkdtemp()) / "level.jsonl"
        for c in args.concurrency:
            cpu0 = thread_cpu()
            child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            load0 = os.getloadavg()[0]
            timeline.begin()
            t0 = time.perf_counter()
            level = await trio.to_thread.run_sync(run_client, url, c, args, tmp)
            wall = time.perf_counter() - t0
            timeline.end()
            cpu1 = thread_cpu()
            child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            client_cpu = sum(
                getattr(child1, f) - getattr(child0, f) for f in ("ru_utime", "ru_stime")
            )
            report_level(c, level, timeline, wall, cpu0, cpu1, loop_tid, load0, client_cpu)
            if args.timeline:
                print_timeline(timeline.steps)
        shutdown.set()
        stack.service.begin_shutdown(0.0)
        nursery.cancel_scope.cancel()


def report_level(
    c: int,
    level: dict[str, Any],
    timeline: Timeline,
    wall: float,
    cpu0: dict[int, float],
    cpu1: dict[int, float],
    loop_tid: int,
    load0: float,
    client_cpu: float,
) -> None:
    steps = timeline.steps
    tokens = level.get("output_tokens") or 0
    agg = level.get("aggregate_tok_s") or 0.0
    ttft = (level.get("ttft_ms") or {}).get("p50")
    print(
        f"\n## concurrency {c}: {level.get('ok', 0)}/{level.get('requests', 0)} ok, "
        f"{tokens} tokens, aggregate {agg:.1f} tok/s, TTFT p50 "
        f"{'-' if ttft is None else f'{ttft:.0f}'} ms; load {load0:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    # What the client saw per token, beside the step's cycle below: a TPOT p50 above
    # the cycle's *mean* is time between the step and the client (the SSE write, the
    # client's own read), not the server's step.
    client = {k: (level.get(f"{k}_ms") or {}) for k in ("tpot", "itl")}
    print(
        "client: TPOT p50 {}, ITL p50 {}, ITL p99 {} ms".format(
            *(
                "-" if client[k].get(q) is None else f"{client[k][q]:.1f}"
                for k, q in (("tpot", "p50"), ("itl", "p50"), ("itl", "p99"))
            )
        )
    )
    decode = [s for s in steps if s.decode_only and s.run_start]
    parts = breakdown(steps)
    print(f"steps: {len(steps)} ({len(decode)} decode-only); per decode step, ms median (mean):")
    for name, values in parts.items():
        print(f"  {name:<10} {ms(values)}")
    # The first token: from the request reaching Service.submit to the launch of the
    # step that sampled it (admission, the membership's safe point, and the earlier
    # chunks of a prompt longer than the step's prefill budget), that step's own
    # cycle, and the handler's write. Paired by seq_id: a prompt of several chunks
    # would otherwise be paired with its first chunk's step.
    firsts: dict[str, list[float]] = {
        "app -> submit": [],
        "submit -> sampling step launched": [],
        "sampling step -> dispatched": [],
        "dispatched -> first bytes": [],
    }
    for entered, first_bytes in timeline.requests:
        t, seq = next(((t, q) for t, q in timeline.admitted if t > entered), (None, None))
        first = next((s for s in steps if seq in s.sampled and s.prefill_rows), None)
        if t is None or first is None or not first.resumed or not first_bytes:
            continue
        dispatched = first.resumed + first.commit + first.dispatch
        firsts["app -> submit"].append(t - entered)
        firsts["submit -> sampling step launched"].append(first.launched - t)
        firsts["sampling step -> dispatched"].append(dispatched - first.launched)
        firsts["dispatched -> first bytes"].append(first_bytes - dispatched)
    # The SSE writes as the app hands them to hypercorn: per request, the mean gap
    # between its writes after the first (the server side of the client's TPOT), and
    # every such gap (the server side of its ITL). The last write or two are the
    # final event and [DONE], right after the last token's: left out.
    tpot_w, gaps_w = [], []
    for writes in timeline.writes:
        w = writes[: len(writes) - 2] if len(writes) > 3 else []
        if len(w) >= 2:
            tpot_w.append((w[-1] - w[0]) / (len(w) - 1))
            gaps_w.extend(b - a for a, b in itertools.pairwise(w))
    print(
        f"SSE writes: per-request mean gap (TPOT) median {ms(tpot_w)}, gap median {ms(gaps_w)} ms"
    )
    print("first token, per request, ms median (mean):")
    for name, values in firsts.items():
        print(f"  {name:<33} {ms(values)}")
    busy = sum(s.run_end - s.run_start for s in steps if s.run_start)
    fwd = sum(s.forward for s in steps)
    level_s = level.get("duration_s") or wall
    print(
        f"worker busy {busy:.2f} s of the level's {level_s:.2f} s (forward {fwd:.2f} s); "
        f"per token: {1e3 * level_s / max(tokens, 1):.2f} ms of the level, "
        f"{1e3 * fwd / max(tokens, 1):.2f} ms of forward"
    )
    loop_cpu = cpu1.get(loop_tid, 0.0) - cpu0.get(loop_tid, 0.0)
    others = sum(cpu1[t] - cpu0.get(t, 0.0) for t in cpu1 if t != loop_tid)
    # All of it shares the 2 cores with the forward pass's threads: the load client
    # (a child process; it loads llama-server the same way; its figure includes its
    # start-up, ~0.5 s of imports) and the event loop.
    per = 1e3 / max(tokens, 1)
    print(
        f"CPU: event loop thread {loop_cpu:.2f} s ({per * loop_cpu:.2f} ms per token), "
        f"the other threads {others:.2f} s ({per * others:.2f} ms per token), the load "
        f"client process {client_cpu:.2f} s ({per * client_cpu:.2f} ms per token)"
    )
    med = {k: round(1e3 * statistics.median(v), 3) if v else None for k, v in parts.items()}
    summary = {
        "concurrency": c,
        "aggregate_tok_s": round(agg, 2),
        "ttft_p50_ms": ttft,
        "client_ms": {
            "tpot_p50": client["tpot"].get("p50"),
            "itl_p50": client["itl"].get("p50"),
            "itl_p99": client["itl"].get("p99"),
        },
        "step_ms": med,
        "step_mean_ms": {
            k: round(1e3 * statistics.fmean(v), 3) if v else None for k, v in parts.items()
        },
        "first_token_ms": {
            k: round(1e3 * statistics.median(v), 3) if v else None for k, v in firsts.items()
        },
        "loop_cpu_ms_per_token": round(per * loop_cpu, 3),
        "client_cpu_ms_per_token": round(per * client_cpu, 3),
        "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
    }
    print("JSON " + json.dumps(summary))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_serverpath.py", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a GGUF file or a model directory")
    p.add_argument("--concurrency", default="1,8", help="levels, one client run each (1,8)")
    p.add_argument("--requests", type=int, default=8, help="requests per level (8)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (32)")
    p.add_argument("--new", type=int, default=32, help="tokens per request (32)")
    p.add_argument("--slots", type=int, default=8, help="server slots (8, as the side-by-side)")
    p.add_argument("--engine-rounds", type=int, default=3, help="engine b=1 repeats (3)")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        help="sys.setswitchinterval for the server (default: Python's 5 ms)",
    )
    p.add_argument(
        "--timeline", action="store_true", help="print every step of each level (rows, ms, ITL)"
    )
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]

    import triollm
    from triollm.model.loader import load_model
    from triollm.server.command import build_stack
    from triollm.service import ServiceConfig
    from triollm.sizing import Capacity

    print(f"triollm from {Path(triollm.__file__).parent}; model {args.model}")
    loaded = load_model(args.model)
    steps = engine_step_s(loaded.model, args.prompt, args.new, args.engine_rounds)
    print(
        "engine b=1 step (forward only, bench_gguf.decode_case), ms per round: "
        + ", ".join(f"{1e3 * s:.2f}" for s in steps)
        + f"; {1 / statistics.median(steps):.1f} tok/s"
    )
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    print(f"GIL switch interval {1e3 * sys.getswitchinterval():g} ms")
    stack = build_stack(loaded, Capacity(slots=args.slots, context_tokens=512), ServiceConfig())
    batch = stack.service.executor
    trio.run(serve_and_load, stack, batch, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
