"""Decode speed on GGUF files, triollm beside llama.cpp, measured alternating.

    python bench/bench_gguf.py FILE.gguf [FILE.gguf ...] [--llama-batched-bench PATH]

For each file, triollm's forward pass runs ragged decode steps at batch 1
and 16 (each sequence at its own position around ``--context``, as
``bench_engine.py`` does) and prints the median ms per step and tokens/s.
With ``--profile`` it then splits one step of each file into stages (weight
products, attention, norms, the rest: ``bench_engine.py``'s profile). With
``--llama-batched-bench`` the same files are run through llama.cpp's
``llama-batched-bench`` (2 threads, a ``--context``-token prompt, 64 new
tokens per sequence), rounds alternating triollm / llama.cpp, so both see
the same machine load; the load average is printed with every round. The
machine is shared: quote medians, and the load.

    python bench/bench_gguf.py --products

times one SmolLM2-shaped product (576 x 1536) per weight format and row
count (1, 4, 16) on one core (thread CPU time, best of ``--reps``): the
kernels alone, robust to sharing, beside that core's bandwidth floor (the
weight bytes over one thread's streaming read, ``measure_bandwidth``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import decode_plan, profile_case, time_steps

from triollm.model.llama import PagedKVCache
from triollm.model.loader import load_model

BATCHES = (1, 16)


CPU: dict[tuple[str, int], list[float]] = {}  # file, batch -> CPU seconds per step


def triollm_round(loaded, context: int, reps: int) -> dict[int, float]:
    out = {}
    for b in BATCHES:
        chunks, blocks = decode_plan(b, context)
        kv = PagedKVCache(loaded.config, blocks, 32)
        wall, cpu = time_steps(loaded.model, chunks, kv, reps)
        out[b] = statistics.median(wall)
        # CPU time of both threads: what the step costs with the cores to itself
        # (passive OpenMP waits burn none), the figure to trust on a shared machine
        CPU.setdefault((Path(loaded.model_dir).name, b), []).append(statistics.median(cpu))
    return out


def llama_round(binary: str, gguf: Path, context: int) -> dict[int, float]:
    cmd = [
        binary, "-m", str(gguf), "-t", "2", "-tb", "2", "-c", str(16 * (context + 64) + 64),
        "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", "64",
        "-npl", ",".join(map(str, BATCHES)), "--output-format", "jsonl",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            b = int(rec["pl"])
            out[b] = b / float(rec["speed_tg"])  # seconds per decode step of b tokens
    return out


def products(reps: int) -> int:
    """One core, SmolLM2's down projection (576 x 1536), every format: thread CPU time."""
    import numba
    import numpy as np

    from triollm.model import matmul, quant
    from triollm.model.synthetic import measure_bandwidth
    from triollm.model.weights import f32_to_bf16_bits

    numba.set_num_threads(1)
    bandwidth = measure_bandwidth(reps=5)[0]  # one thread's best streaming read
    rng = np.random.default_rng(0)
    out_f, in_f = 576, 1536
    print(f"one core's streaming read: {bandwidth / 1e9:.1f} GB/s (the floor column)")
    print("| format | bytes | rows | ms | floor ms | GB/s | GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt in ["f32", "bf16", "f16", *(q.name for q in quant.QuantType)]:
        ws = []
        for _ in range(8):  # distinct weights: more than the caches hold
            w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)
            if fmt == "f32":
                ws.append(matmul.prepare(w))
            elif fmt == "bf16":
                ws.append(matmul.prepare(f32_to_bf16_bits(w), bf16=True))
            elif fmt == "f16":
                ws.append(matmul.prepare(w.astype(np.float16)))
            elif quant.QuantType[fmt] < quant.QuantType.Q4_K:
                ws.append(quant.quantize(w, quant.QuantType[fmt]))
            else:  # no K-quant quantizer in gguf: sane random blocks
                qt = quant.QuantType[fmt]
                raw = rng.integers(0, 256, (out_f, in_f // 256 * qt.block_bytes), np.uint8)
                ws.append(quant.QuantizedTensor(qt, (out_f, in_f), raw))
        for n in (1, 4, 16):
            x = rng.standard_normal((n, in_f)).astype(np.float32)
            matmul.linear(x, ws[0])
            best = float("inf")
            for _ in range(reps):
                t = time.thread_time()
                for w in ws:
                    matmul.linear(x, w)
                best = min(best, (time.thread_time() - t) / len(ws))
            nbytes = ws[0].nbytes
            print(
                f"| {fmt} | {nbytes} | {n} | {1e3 * best:.3f} | {1e3 * nbytes / bandwidth:.3f} "
                f"| {nbytes / best / 1e9:.1f} | {2 * n * out_f * in_f / best / 1e9:.1f} |"
            )
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--products", action="store_true", help="per-core product timings instead")
    p.add_argument("--llama-batched-bench", help="path to llama.cpp's llama-batched-bench")
    p.add_argument("--context", type=int, default=64, help="positions before decoding (64)")
    p.add_argument("--reps", type=int, default=15, help="timed steps per case (15)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    p.add_argument("--profile", action="store_true", help="then a per-stage split of a step")
    args = p.parse_args(argv)
    if args.products:
        return products(args.reps)
    loaded = {f: load_model(f) for f in args.files}
    results: dict[tuple[str, str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for f in args.files:
            for system in ("triollm", "llama.cpp"):
                if system == "llama.cpp" and not args.llama_batched_bench:
                    continue
                load = os.getloadavg()[0]
                if system == "triollm":
                    r = triollm_round(loaded[f], args.context, args.reps)
                else:
                    r = llama_round(args.llama_batched_bench, f, args.context)
                for b, s in r.items():
                    results.setdefault((f.name, system, b), []).append(s)
                figures = ", ".join(f"b{b} {1e3 * s:.1f} ms" for b, s in sorted(r.items()))
                print(f"round {rnd} {f.name} {system}: {figures} (load {load:.1f})", flush=True)
    print()
    print("| file | system | batch | wall ms/step | tok/s | CPU ms/step (2 threads) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (name, system, b), v in sorted(results.items()):
        s = statistics.median(v)
        cpu = CPU.get((name, b)) if system == "triollm" else None  # timed for ours only
        c = f"{1e3 * statistics.median(cpu):.1f}" if cpu else "-"
        print(f"| {name} | {system} | {b} | {1e3 * s:.1f} | {b / s:.1f} | {c} |")
    if args.profile:
        print_profiles(loaded, args.context, args.reps)
    return 0


def print_profiles(loaded: dict, context: int, reps: int) -> None:
    """Per-stage ms of one step, every file at every batch (bench_engine's profile)."""
    columns = []
    for f, model in loaded.items():
        for b in BATCHES:
            chunks, blocks = decode_plan(b, context)
            kv = PagedKVCache(model.config, blocks, 32)
            columns.append((f"{f.name} b{b}", profile_case(model.model, chunks, kv, reps)))
    print(f"\nper-stage ms per step (load {os.getloadavg()[0]:.1f})")
    print("| stage | " + " | ".join(name for name, _ in columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for stage in columns[0][1]:
        row = " | ".join(f"{1e3 * p.get(stage, 0.0):.2f}" for _, p in columns)
        print(f"| {stage} | {row} |")


if __name__ == "__main__":
    raise SystemExit(main())
