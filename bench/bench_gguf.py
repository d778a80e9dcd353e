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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import decode_plan, time_steps

from triollm.model.llama import PagedKVCache
from triollm.model.loader import load_model

BATCHES = (1, 16)


def triollm_round(loaded, context: int, reps: int) -> dict[int, float]:
    out = {}
    for b in BATCHES:
        chunks, blocks = decode_plan(b, context)
        kv = PagedKVCache(loaded.config, blocks, 32)
        wall, _ = time_steps(loaded.model, chunks, kv, reps)
        out[b] = statistics.median(wall)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--llama-batched-bench", help="path to llama.cpp's llama-batched-bench")
    p.add_argument("--context", type=int, default=64, help="positions before decoding (64)")
    p.add_argument("--reps", type=int, default=15, help="timed steps per case (15)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    args = p.parse_args(argv)
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
    print("| file | system | batch | ms/step (median of rounds) | tok/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (name, system, b), v in sorted(results.items()):
        s = statistics.median(v)
        print(f"| {name} | {system} | {b} | {1e3 * s:.1f} | {b / s:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
