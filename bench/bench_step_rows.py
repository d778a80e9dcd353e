"""The serving step budget: prefill chunk size and rows per step, against decode stalls.

Run with ``python bench/bench_step_rows.py`` (``--quick`` for a smoke run).

A step is one forward pass, and every running sequence waits for it. When a long
prompt arrives, its prefill is cut into chunks of at most ``chunk`` tokens, and
each step carries at most ``step_rows`` rows (the scheduler puts left-out
decoders first next step, then prefill chunks, then the other decoders). So the
two knobs trade the newcomer's time to first token (TTFT: fewer, bigger chunks)
against the inter-token latency of everyone already decoding (every step that
carries a chunk is as slow as the chunk).

The scenario, for each ``(chunk, step_rows)`` setting, on the SmolLM2-135M-shaped
model with random weights that ``bench_engine.py`` builds (nothing is
downloaded), driven through the real :class:`~triollm.scheduler.Scheduler` and
:class:`~triollm.batch.Batch` synchronously (the server's loop without trio):

1. ``--decoders`` sequences (short prompts) are prefilled and decode a few steps;
2. a ``--prompt``-token prompt arrives; the steps run until its first token;
3. a few more steps, then everything is cancelled.

With ``--wave N`` step 2 is N prompts arriving together instead of one (the
served conc-8 load: 8 short prompts at once, the first already decoding when the
other seven are admitted). That is the case the step's prefill budget is for:
while any sequence decodes, the chunk bounds the prefill rows of the whole step,
shared by every waiting prompt (``Scheduler.plan_step``, docs/scheduling.md §5);
before that rule each prompt had its own chunk, the wave filled ``step_rows``,
the decoders were pushed out of every second step, and a stream's gap was two
full steps (served ITL p99 2.4x llama-server's on Qwen2.5-1.5B). Run the same
command with ``PYTHONPATH`` naming an old and a new tree to compare the rules.

Reported per setting: the decoders' inter-token latency while the long prompt
was being prefilled (median / p95 / max of the gaps between one decoder's
consecutive tokens), the newcomer's TTFT (from its arrival to its first token),
the steps the prefill took, and the throughput over the prefill phase (prompt
tokens plus decoded tokens per second). The machine is shared: settings are
run in an interleaved order, ``--rounds`` times, and medians over rounds are
printed with the load average.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import BLOCK_SIZE, SMOLLM2_135M, load_average, random_weights

from triollm.batch import Batch
from triollm.model import kernels, matmul
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel
from triollm.model.sampling import SamplingParams
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.spec import GenerationSpec, SequenceSpec


@dataclass(frozen=True)
class Outcome:
    """One scenario run under one setting (seconds)."""

    chunk: int
    step_rows: int
    ttft: float  # the long prompt's arrival -> its first token (the wave's last first token)
    prefill_steps: int  # steps from its arrival to its first token
    gaps: tuple[float, ...]  # decoders' inter-token gaps during the prefill phase
    quiet_gaps: tuple[float, ...]  # the same before the long prompt arrived (decode only)
    throughput: float  # (prompt tokens + decoded tokens) / seconds, prefill phase


def run_scenario(
    model: LlamaModel,
    *,
    chunk: int,
    step_rows: int,
    slots: int,
    decoders: int,
    prompt_len: int,
    warm_steps: int = 5,
    seed: int = 0,
    wave: int = 1,
    stall_rows: int | None = None,
) -> Outcome:
    """Drive Scheduler + Batch through the scenario of the module docstring once
    (``stall_rows`` None: SchedulerConfig's default, the chunk)."""
    context = prompt_len + 256
    blocks_per_seq = -(-context // BLOCK_SIZE)
    config = SchedulerConfig(
        num_blocks=slots * blocks_per_seq,
        block_size=BLOCK_SIZE,
        slots=slots,
        chunk_tokens=chunk,
        step_rows=step_rows,
        context_tokens=context,
        **({} if stall_rows is None else {"stall_rows": stall_rows}),
    )
    scheduler = Scheduler(config)
    batch = Batch(model, num_blocks=config.num_blocks, block_size=BLOCK_SIZE)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    greedy = SamplingParams(temperature=0.0)

    def submit(n_tokens: int) -> int:
        prompt = [int(t) for t in rng.integers(3, vocab, size=n_tokens)]
        seq_id = scheduler.add(SequenceSpec(prompt, 200))
        batch.add(seq_id, GenerationSpec(prompt, greedy))
        return seq_id

    def step() -> tuple[float, set[int]]:
        """One turn of the loop; returns when it ended and which sequences got a token."""
        scheduler.admit_waiting()
        plan = scheduler.plan_step()
        if plan.is_empty:
            raise RuntimeError(f"nothing runnable: {scheduler.statistics()}")
        result = batch.run(plan)
        for done in scheduler.commit(result):
            batch.remove(done.seq_id)
        return time.perf_counter(), {t.seq_id for t in result.sampled}

    # 1. the decoders: short prompts, prefilled and decoding
    decoding = [submit(32) for _ in range(decoders)]
    last: dict[int, float] = {}
    quiet: list[float] = []
    for _ in range(warm_steps):
        t, got = step()
        for s in got:
            if s in last:
                quiet.append(t - last[s])
            last[s] = t
    # 2. the long prompt (or a wave of prompts) arrives; run until every first token
    newcomers = {submit(prompt_len) for _ in range(wave)}
    waiting = set(newcomers)
    arrival = time.perf_counter()
    gaps: list[float] = []
    steps = 0
    decoded = 0
    while True:
        t, got = step()
        steps += 1
        for s in got:
            if s in last:
                gaps.append(t - last[s])
            last[s] = t
        decoded += len(got & set(decoding))
        waiting -= got
        if not waiting:
            break
        if steps > prompt_len * wave:  # bounded: a chunk is at least one token
            raise RuntimeError("the long prompt never got its first token")
    elapsed = t - arrival
    for s in [*decoding, *newcomers]:
        scheduler.cancel(s)
        batch.remove(s)
    return Outcome(
        chunk=chunk,
        step_rows=step_rows,
        ttft=elapsed,
        prefill_steps=steps,
        gaps=tuple(gaps),
        quiet_gaps=tuple(quiet),
        throughput=(prompt_len * wave + decoded) / elapsed,
    )


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def parse_settings(text: str, slots: int) -> list[tuple[int, int]]:
    """``"256,512:544,512:1024"`` -> (chunk, step_rows); a bare chunk gets chunk + slots."""
    out = []
    for item in text.split(","):
        if ":" in item:
            c, r = item.split(":")
            out.append((int(c), int(r)))
        else:
            out.append((int(item), int(item) + slots))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--settings",
        default="64,128,256,512,512:512,1024",
        help="comma-separated chunk[:step_rows] (bare chunk: step_rows = chunk + slots)",
    )
    p.add_argument("--slots", type=int, default=4, help="sequences running at once (4)")
    p.add_argument("--decoders", type=int, default=3, help="sequences decoding (3)")
    p.add_argument("--prompt", type=int, default=1500, help="long prompt tokens (1500)")
    p.add_argument(
        "--wave", type=int, default=1, help="prompts arriving together (1; see the docstring)"
    )
    p.add_argument(
        "--stall",
        default="",
        help="comma-separated stall_rows values, each run with every setting (default: "
        "the chunk; docs/scheduling.md, the stall budget)",
    )
    p.add_argument("--rounds", type=int, default=2, help="runs of every setting (2)")
    p.add_argument("--dtype", default="bf16", choices=("f32", "bf16"), help="weights (bf16)")
    p.add_argument("--quick", action="store_true", help="one round, 300-token prompt")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.prompt = 1, 300
    if args.decoders + args.wave > args.slots:
        p.error("--decoders + --wave must fit in --slots (every prompt of the wave runs)")
    stalls: list[int | None] = [int(x) for x in args.stall.split(",") if x] or [None]
    settings = [(c, r, t) for c, r in parse_settings(args.settings, args.slots) for t in stalls]
    for c, _, t in settings:
        if t is not None and not 1 <= t <= c:
            p.error(f"--stall {t} must be between 1 and the chunk {c}")

    print(f"# triollm bench-step-rows — {datetime.datetime.now().isoformat(timespec='minutes')}")
    print(f"command: python bench/bench_step_rows.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"{os.cpu_count()} CPUs; load average at start: {load_average()}")
    config = ModelConfig.from_dict(SMOLLM2_135M, source="SmolLM2-135M shape (built in)")
    model = LlamaModel(config, random_weights(config, args.dtype))
    matmul.warm_up()
    kernels.warm_up()
    print(
        f"{args.dtype} weights; {args.decoders} decoders + {args.wave} {args.prompt}-token "
        "prompt(s) arriving together, "
        f"{args.slots} slots; {args.rounds} round(s), settings interleaved\n"
    )
    # One untimed run so the first timed setting does not pay first-touch costs.
    run_scenario(
        model, chunk=64, step_rows=68, slots=args.slots, decoders=args.decoders, prompt_len=128
    )
    results: dict[tuple[int, int, int | None], list[Outcome]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for chunk, rows, stall in settings:
            results[(chunk, rows, stall)].append(
                run_scenario(
                    model,
                    chunk=chunk,
                    step_rows=rows,
                    slots=args.slots,
                    decoders=args.decoders,
                    prompt_len=args.prompt,
                    wave=args.wave,
                    stall_rows=stall,
                )
            )
    print(
        "| chunk | step_rows | stall_rows | prefill steps | TTFT s | decode gap median ms "
        "| p95 ms | max ms | decode-only gap ms | tok/s (prefill phase) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (chunk, rows, stall), runs in results.items():
        gaps = [g for r in runs for g in r.gaps]
        quiet = [g for r in runs for g in r.quiet_gaps]
        print(
            f"| {chunk} | {rows} | {chunk if stall is None else stall} | {runs[0].prefill_steps} "
            f"| {statistics.median(r.ttft for r in runs):.2f} "
            f"| {1000 * statistics.median(gaps):.0f} | {1000 * percentile(gaps, 95):.0f} "
            f"| {1000 * max(gaps):.0f} | {1000 * statistics.median(quiet):.0f} "
            f"| {statistics.median(r.throughput for r in runs):.0f} |"
        )
    print(f"\nload average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
