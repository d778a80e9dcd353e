"""The fused layer kernel against the per-product path, in one process, alternating.

Run with ``python bench/bench_layer.py``. Builds the SmolLM2-135M-shaped model
of ``bench_engine.py`` (random weights) and times the same decode and prefill
steps with ``LlamaModel.fused`` on (``layer.decoder_layer``: one parallel
region per layer) and off (a region per product and per kernel), A B A B, so
both see the same machine. Prints medians of wall and CPU time per step and the
load average; on a shared machine read the ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import (
    BLOCK_SIZE,
    SMOLLM2_135M,
    decode_plan,
    load_average,
    prefill_plan,
    random_weights,
)

from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel, PagedKVCache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8, help="A/B rounds per case")
    args = p.parse_args(argv)
    config = ModelConfig.from_dict(SMOLLM2_135M)
    print(f"command: python bench/bench_layer.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"load average at start: {load_average()}")
    print("| weights | step | per-product ms (CPU) | fused ms (CPU) | per-product / fused |")
    print("| --- | --- | ---: | ---: | ---: |")
    for dtype in args.dtypes.split(","):
        model = LlamaModel(config, random_weights(config, dtype))
        batches = [int(b) for b in args.batches.split(",")]
        cases = [(f"decode {b}", *decode_plan(b, args.context)) for b in batches]
        if args.prefill:
            cases.append((f"prefill {args.prefill}", *prefill_plan(args.prefill)))
        for name, chunks, nb in cases:
            kv = PagedKVCache(config, nb, BLOCK_SIZE)
            rounds = max(2, args.rounds // 3) if name.startswith("prefill") else args.rounds
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for fused in (False, True):  # warm up (and compile) both
                model.fused = fused
                model.forward(chunks, kv)
            for _ in range(rounds):
                for fused in (False, True):
                    model.fused = fused
                    c, t = time.process_time(), time.perf_counter()
                    model.forward(chunks, kv)
                    times[fused].append((time.perf_counter() - t, time.process_time() - c))
            med = {}
            for f, v in times.items():
                med[f] = (
                    statistics.median(w for w, _ in v) * 1e3,
                    statistics.median(c for _, c in v) * 1e3,
                )
            print(
                f"| {dtype} | {name} | {med[False][0]:.1f} ({med[False][1]:.1f}) | "
                f"{med[True][0]:.1f} ({med[True][1]:.1f}) | {med[False][0] / med[True][0]:.2f} |",
                flush=True,
            )
        model.fused = True
    print(f"load average at end: {load_average()}; {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
