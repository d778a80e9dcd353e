"""Decode speed on GGUF files, triollm beside llama.cpp, measured alternating.

    python bench/bench_gguf.py FILE.gguf [FILE.gguf ...] [--llama-batched-bench PATH]

For each file, triollm's forward pass runs ragged decode steps at batch 1
and 16 (each sequence at its own position around ``--context``, as
``bench_engine.py`` does) and prints the median ms per step and tokens/s.
With ``--llama-batched-bench`` the same files are run through llama.cpp's
``llama-batched-bench`` (2 threads, a ``--context``-token prompt, 64 new
tokens per sequence), rounds alternating triollm / llama.cpp, so both see
the same machine load; the load average is printed with every round. The
machine is shared: quote medians, and the load.

    python bench/bench_gguf.py --products

times one SmolLM2-shaped product (576 x 1536) per weight format on one core
(thread CPU time, best of ``--reps``): the kernels alone, robust to sharing.
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

from bench_engine import decode_plan, time_steps

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
    from triollm.model.weights import f32_to_bf16_bits

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    out_f, in_f = 576, 1536
    print("| format | bytes | rows | ms | GB/s | GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for fmt in ["bf16", "f16", *(q.name for q in quant.QuantType)]:
        ws = []
        for _ in range(8):  # distinct weights: more than the caches hold
            w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)
            if fmt == "bf16":
                ws.append(matmul.prepare(f32_to_bf16_bits(w), bf16=True))
            elif fmt == "f16":
                ws.append(matmul.prepare(w.astype(np.float16)))
            elif quant.QuantType[fmt] < quant.QuantType.Q4_K:
                ws.append(quant.quantize(w, quant.QuantType[fmt]))
            else:  # no K-quant quantizer in gguf: sane random blocks
                qt = quant.QuantType[fmt]
                raw = rng.integers(0, 256, (out_f, in_f // 256 * qt.block_bytes), np.uint8)
                ws.append(quant.QuantizedTensor(qt, (out_f, in_f), raw))
        for n in (1, 16):
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
                f"| {fmt} | {nbytes} | {n} | {1e3 * best:.3f} | {nbytes / best / 1e9:.1f} "
                f"| {2 * n * out_f * in_f / best / 1e9:.1f} |"
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
