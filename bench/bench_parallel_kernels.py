"""The small kernels' serial and parallel drivers side by side, and what a region costs.

    python bench/bench_parallel_kernels.py             # drivers, 3 interleaved rounds
    python bench/bench_parallel_kernels.py --spin      # a region after a gap, per spin count

Each kernel that has a ``prange`` also has a serial driver calling the same
compiled row or item function: attention's ``_attend`` / ``_attend_serial``
(chosen per step by ``plan.parallel``, from ``PARALLEL_MIN_WORK``), SwiGLU's
``_silu_rows`` / ``_silu_rows_serial`` and the int8 activations'
``_quantize_rows`` / ``_quantize_rows_serial`` (one row: the serial one). So
the two columns differ only in the parallel region. The cases, on one layer of
SmolLM2-135M's shape (9 query heads, 3 KV heads of 64, f16 cache, blocks of
32): one decode row at position 368, 16 decode rows at 128-368, a 512-row
prefill chunk; SwiGLU (1536 wide) and the quantization of a 576-wide row, each
on 1 and 512 rows. Medians, with the load average: on a shared machine a
parallel region only wins when the second core is free.

``--spin``: libgomp makes a waiting worker poll ``GOMP_SPINCOUNT`` times before
it sleeps on a futex; triollm starts it passive (0 polls, ``model/threads.py``).
For each count (a fresh process each: libgomp reads it once) an empty region
after a serial gap of 0 to 3000 us: its median time and the process's sleeps
per region (``bench_engine.thread_sleeps``'s count).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from triollm.model import kernels, quant_int8

N_HEADS, N_KV, HEAD_DIM, BLOCK = 9, 3, 64, 32
HIDDEN, INTERMEDIATE = 576, 1536


def median_us(f: Callable[[], None], reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e6


def attention_case(rows: int, prefill: bool, rng: np.random.Generator) -> Callable[[bool], None]:
    """One layer's attention for a decode batch or a prefill chunk, either driver."""
    if prefill:
        n_blocks = -(-rows // BLOCK)
        positions = np.arange(rows, dtype=np.int64)
        chunk = np.zeros(rows, np.int64)
        tables = np.arange(n_blocks, dtype=np.int64).reshape(1, n_blocks)
    else:
        per_seq = 16  # 512 positions: room for the contexts below
        n_blocks = rows * per_seq
        positions = (368 - 16 * np.arange(rows)[::-1]).astype(np.int64)
        chunk = np.arange(rows, dtype=np.int64)
        tables = np.arange(n_blocks, dtype=np.int64).reshape(rows, per_seq)
    # f16 (the default cache) as int16 bits; K transposed within a block
    k = rng.standard_normal((n_blocks, N_KV, HEAD_DIM, BLOCK)).astype(np.float16).view(np.int16)
    v = rng.standard_normal((n_blocks, N_KV, BLOCK, HEAD_DIM)).astype(np.float16).view(np.int16)
    q = rng.standard_normal((rows, N_HEADS, HEAD_DIM)).astype(np.float32)
    out = np.empty_like(q)
    plan = kernels.plan_attention(positions, chunk, 0, N_KV, N_HEADS, HEAD_DIM)
    plans = {p: dataclasses.replace(plan, parallel=p) for p in (False, True)}

    def run(parallel: bool) -> None:
        kernels.paged_attention(
            q, k, v, positions, chunk, tables, 0, np.float32(0.125), out, plan=plans[parallel]
        )

    return run


def drivers(args: argparse.Namespace) -> None:
    kernels.warm_up()
    rng = np.random.default_rng(0)
    cases: list[tuple[str, Callable[[bool], None], int]] = [
        ("attention, 1 decode row at 368", attention_case(1, False, rng), 500),
        ("attention, 16 decode rows at 128-368", attention_case(16, False, rng), 100),
        ("attention, 512-row prefill", attention_case(512, True, rng), 5),
    ]
    for rows in (1, 512):
        gate_up = rng.standard_normal((rows, 2 * INTERMEDIATE)).astype(np.float32)
        act = np.empty((rows, INTERMEDIATE), np.float32)
        x = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
        q8 = np.empty((rows, HIDDEN), np.int8)
        d = np.empty((rows, HIDDEN // 32), np.float32)
        sums = np.empty((rows, HIDDEN // quant_int8.SUM_VALUES), np.int32)

        def silu(parallel: bool, g: np.ndarray = gate_up, o: np.ndarray = act) -> None:
            (kernels._silu_rows if parallel else kernels._silu_rows_serial)(g, o)

        def quantize(
            parallel: bool, x: np.ndarray = x, q: Any = q8, d: Any = d, s: Any = sums
        ) -> None:
            fn = quant_int8._quantize_rows if parallel else quant_int8._quantize_rows_serial
            fn(x, 32, q, d, s)

        reps = 500 if rows == 1 else 20
        cases.append((f"SwiGLU, {rows} rows", silu, reps))
        cases.append((f"int8 activations, {rows} rows of {HIDDEN}", quantize, reps))
    print(f"load average at start: {load_average()}")
    print("| case | round | serial us | parallel us |\n| --- | ---: | ---: | ---: |")
    for name, run, reps in cases:
        for rnd in range(args.rounds):
            order = (False, True) if rnd % 2 == 0 else (True, False)
            got = {p: median_us(lambda p=p, r=run: r(p), reps) for p in order}
            print(f"| {name} | {rnd + 1} | {got[False]:.1f} | {got[True]:.1f} |", flush=True)
    print(f"load average at end: {load_average()}")


_SPIN_CHILD = """
import os, statistics, sys, time
import numpy as np
from numba import njit, prange
from triollm.model import kernels  # starts the runtime (model/threads.py)
sys.path.insert(0, {bench!r})
from bench_engine import thread_sleeps

@njit(parallel=True, nogil=True)
def region(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0

a = np.zeros(2)
for _ in range(100):
    region(a)
for gap_us in (0, 20, 100, 300, 1000, 3000):
    times = []
    s0 = thread_sleeps()
    for _ in range({reps}):
        t = time.perf_counter()
        region(a)
        times.append(time.perf_counter() - t)
        end = time.perf_counter() + gap_us * 1e-6
        while time.perf_counter() < end:
            pass
    slept = (thread_sleeps() - s0) / {reps}
    print(gap_us, statistics.median(times) * 1e6, slept, flush=True)
"""


def spin(args: argparse.Namespace) -> None:
    bench = os.path.dirname(os.path.abspath(__file__))
    code = _SPIN_CHILD.format(bench=bench, reps=args.reps)
    print(f"load average at start: {load_average()}")
    print("| GOMP_SPINCOUNT | gap before the region, us | region us (median) | sleeps per region |")
    print("| ---: | ---: | ---: | ---: |")
    for count in args.counts.split(","):
        env = dict(os.environ, GOMP_SPINCOUNT=count)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        for line in out.split("\n"):
            if line.strip():
                gap, us, slept = line.split()
                print(f"| {count} | {gap} | {float(us):.1f} | {float(slept):.2f} |", flush=True)
    print(f"load average at end: {load_average()}")


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    p.add_argument("--spin", action="store_true", help="region cost after a gap, per spin count")
    p.add_argument("--counts", default="0,1000,10000,100000", help="--spin: GOMP_SPINCOUNT values")
    p.add_argument("--reps", type=int, default=300, help="--spin: regions per gap")
    args = p.parse_args(argv)
    if args.spin:
        spin(args)
    else:
        drivers(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
