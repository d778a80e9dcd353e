"""What the n choices of one prompt save by sharing it: one group against n requests.

Run with ``python bench/bench_choices.py`` (``--quick`` for a smoke run).

The real Scheduler and Batch, in process, on a SmolLM2-135M-shaped model with
random bf16 weights (nothing is downloaded; no HTTP, no tokenizer). The same work,
``--n`` answers of ``--answer`` tokens to one ``--prompt``-token prompt, two ways:

- **group**: ``Scheduler.add_group`` (what ``n`` does over HTTP): the prompt's full
  blocks are computed once and held by every choice;
- **separate**: ``n`` requests of the same prompt arriving together (what a client
  that cannot ask for ``n`` sends): each computes and holds the whole prompt. With
  the prefix cache on it is no better, since nothing is published before the first
  prefill commits.

Each choice samples with ``seed + i`` (as the server gives them), so the two ways
must give the same answers, which is checked. Printed per way: prompt rows computed,
KV blocks held at the peak, the time to the last choice's first token and to the end,
alternating group and separate for ``--reps`` rounds; medians, their ratio, and the
load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import BLOCK_SIZE, SMOLLM2_135M, random_weights

from triollm.batch import Batch
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel
from triollm.model.sampling import SamplingParams
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.spec import GenerationSpec, SequenceSpec


def run(
    model: LlamaModel, prompt: list[int], *, n: int, answer: int, grouped: bool, seed: int
) -> dict[str, object]:
    """One way, to the end: its figures and its answers."""
    cfg = SchedulerConfig(
        num_blocks=n * 2048 // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        slots=n,
        chunk_tokens=128,
        context_tokens=2048,
        prefix_cache=True,
    )
    s = Scheduler(cfg)
    batch = Batch(model, num_blocks=cfg.num_blocks, block_size=BLOCK_SIZE)
    t0 = time.perf_counter()
    if grouped:
        ids = s.add_group(SequenceSpec(prompt, answer, n=n))
    else:
        ids = tuple(s.add(SequenceSpec(prompt, answer)) for _ in range(n))
    for i, seq in enumerate(ids):
        batch.add(seq, GenerationSpec(prompt, SamplingParams(temperature=1.0, seed=seed + i)))
    first: dict[int, float] = {}
    answers: dict[int, list[int]] = {seq: [] for seq in ids}
    prompt_rows = peak = 0
    live = set(ids)
    while live:
        s.admit_waiting()
        peak = max(peak, s.statistics().blocks_held)
        plan = s.plan_step()
        prompt_rows += sum(c.n_rows for c in plan.chunks if c.prefill)
        result = batch.run(plan)
        for tok in result.sampled:
            first.setdefault(tok.seq_id, time.perf_counter() - t0)
            answers[tok.seq_id].append(tok.token_id)
        for f in s.commit(result):
            live.discard(f.seq_id)
            batch.remove(f.seq_id)
    return {
        "prompt_rows": prompt_rows,
        "peak_blocks": peak,
        "last_first_token_s": max(first.values()),
        "seconds": time.perf_counter() - t0,
        "answers": [answers[q] for q in ids],
    }


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4, help="choices (4)")
    p.add_argument("--prompt", type=int, default=1000, help="prompt tokens (1000)")
    p.add_argument("--answer", type=int, default=32, help="tokens each choice answers (32)")
    p.add_argument("--reps", type=int, default=3, help="group/separate rounds (3)")
    p.add_argument("--quick", action="store_true", help="a 100-token prompt, 4 tokens, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.answer, args.reps = 100, 4, 1
    config = ModelConfig.from_dict(SMOLLM2_135M, source="SmolLM2-135M shape (built in)")
    model = LlamaModel(config, random_weights(config, "bf16"))
    print("# triollm n choices: SmolLM2-135M shape, random bf16 weights, in process")
    print(f"command: python bench/bench_choices.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"load average at start: {load_average()}")
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(3, config.vocab_size, args.prompt)]
    run(model, [5] * 40, n=2, answer=2, grouped=True, seed=0)  # compile + warm up

    print(f"\n{args.n} choices of a {args.prompt}-token prompt, {args.answer} tokens each")
    print("| round | way | prompt rows | peak KV blocks | last first token (ms) | end (ms) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    figures: dict[str, list[dict[str, object]]] = {"group": [], "separate": []}
    for rep in range(args.reps):
        for way in ("group", "separate"):
            f = run(model, prompt, n=args.n, answer=args.answer, grouped=way == "group", seed=rep)
            figures[way].append(f)
            print(
                f"| {rep + 1} | {way} | {f['prompt_rows']} | {f['peak_blocks']} | "
                f"{f['last_first_token_s'] * 1e3:.0f} | {f['seconds'] * 1e3:.0f} |"
            )
        same = figures["group"][-1]["answers"] == figures["separate"][-1]["answers"]
        if not same:
            print(f"round {rep + 1}: the two ways gave different answers")
            return 1
    print("the two ways gave the same answers in every round (choice i: seed + i)")
    for key, label in (("last_first_token_s", "last first token"), ("seconds", "end")):
        g = statistics.median(float(f[key]) for f in figures["group"])  # type: ignore[arg-type]
        sep = statistics.median(float(f[key]) for f in figures["separate"])  # type: ignore[arg-type]
        print(
            f"median {label}: group {g * 1e3:.0f} ms, separate {sep * 1e3:.0f} ms, "
            f"separate / group = {sep / g:.2f}x"
        )
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
