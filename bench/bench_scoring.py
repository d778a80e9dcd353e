"""What scoring a prompt costs (echo with logprobs): its prefill with and without it.

Run with ``python bench/bench_scoring.py`` (``--quick`` for a smoke run).

The real Scheduler and Batch, in process, on a SmolLM2-135M-shaped model with
random bf16 weights (nothing is downloaded; no HTTP, no tokenizer). One
``--prompt``-token prompt is prefilled in the server's 128-row chunks, to its first
token, two ways, alternated for ``--reps`` rounds:

- **plain**: ``Scheduler.add`` as any request;
- **scored**: ``Scheduler.add(..., score_prompt=True)`` (Scheduler rule 11): every
  chunk also runs the output head over its rows, 64 at a time
  (``batch.SCORE_SLICE_ROWS``), and returns each prompt token's log-probability.

Printed per round: the seconds to the first token and the prompt positions scored;
then the medians, their ratio, and the load average before and after.
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


def prefill(model: LlamaModel, prompt: list[int], *, scored: bool) -> tuple[float, int]:
    """(seconds to the first token, prompt positions scored) of one prompt alone."""
    cfg = SchedulerConfig(num_blocks=2048 // BLOCK_SIZE, block_size=BLOCK_SIZE, slots=1)
    s = Scheduler(cfg)
    batch = Batch(model, num_blocks=cfg.num_blocks, block_size=BLOCK_SIZE)
    t0 = time.perf_counter()
    seq = s.add(SequenceSpec(prompt, 1, score_prompt=scored))
    batch.add(seq, GenerationSpec(prompt, SamplingParams(temperature=0.0, logprobs=1)))
    s.admit_waiting()
    positions = 0
    while s.running_ids():
        plan = s.plan_step()
        result = batch.run(plan)
        positions += sum(len(c.logprobs) for c in result.scores)
        s.commit(result)
    return time.perf_counter() - t0, positions


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (512)")
    p.add_argument("--reps", type=int, default=5, help="plain/scored rounds (5)")
    p.add_argument("--quick", action="store_true", help="a 100-token prompt, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.reps = 100, 1
    config = ModelConfig.from_dict(SMOLLM2_135M, source="SmolLM2-135M shape (built in)")
    model = LlamaModel(config, random_weights(config, "bf16"))
    print("# triollm prompt scoring: SmolLM2-135M shape, random bf16 weights, in process")
    print(f"command: python bench/bench_scoring.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"load average at start: {load_average()}")
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, config.vocab_size, args.prompt)]
    for scored in (False, True):  # compile + warm up
        prefill(model, prompt[:40], scored=scored)

    print(f"\na {args.prompt}-token prompt to its first token, chunks of 128 rows")
    print("| round | way | positions scored | seconds |")
    print("| ---: | --- | ---: | ---: |")
    seconds: dict[str, list[float]] = {"plain": [], "scored": []}
    for rep in range(args.reps):
        for way in ("plain", "scored"):
            dt, positions = prefill(model, prompt, scored=way == "scored")
            seconds[way].append(dt)
            print(f"| {rep + 1} | {way} | {positions} | {dt:.3f} |")
    plain, scored = (statistics.median(seconds[w]) for w in ("plain", "scored"))
    ratio = scored / plain
    print(f"median: plain {plain:.3f} s, scored {scored:.3f} s, scored / plain = {ratio:.2f}x")
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
