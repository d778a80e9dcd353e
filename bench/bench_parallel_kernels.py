"""Serial against parallel attention and SwiGLU, in one process, interleaved.

Run with ``python bench/bench_parallel_kernels.py``. The serial variant is
compiled from the same Python function as the engine's kernel
(``dispatcher.py_func``) with ``parallel=False`` and no disk cache, so the two
differ only in ``prange``; neither is imported twice (docs/performance.md: the
numba cache-name hazard). One layer of SmolLM2-135M's shape (9 query heads, 3
KV heads of 64, blocks of 32): 16 decode rows at contexts 128-368, one
512-row prefill chunk, and SwiGLU on 512 rows. Medians; the load average is
printed, because on a shared machine a parallel kernel only wins when a
second core is free.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from triollm.model import kernels

N_HEADS, N_KV, HEAD_DIM, BLOCK = 9, 3, 64, 32


def median_ms(f: Callable[..., None], args: tuple[Any, ...], reps: int) -> float:
    f(*args)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def attention_args(rows: int, prefill: bool, rng: np.random.Generator) -> tuple[Any, ...]:
    """Arguments of paged_attention for one decode batch or one prefill chunk."""
    if prefill:
        n_blocks = -(-rows // BLOCK)
        positions = np.arange(rows, dtype=np.int64)
        chunk = np.zeros(rows, np.int64)
        tables = np.arange(n_blocks, dtype=np.int64).reshape(1, n_blocks)
    else:
        per_seq = 16  # 512 positions: room for the contexts below
        n_blocks = rows * per_seq
        positions = (128 + 16 * np.arange(rows)).astype(np.int64)
        chunk = np.arange(rows, dtype=np.int64)
        tables = np.arange(n_blocks, dtype=np.int64).reshape(rows, per_seq)
    shape = (n_blocks, N_KV, BLOCK, HEAD_DIM)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((rows, N_HEADS, HEAD_DIM), dtype=np.float32)
    out = np.empty_like(q)
    return (q, k, v, positions, chunk, tables, 0, np.float32(0.125), out)


def main() -> int:
    serial_attention = njit(nogil=True, fastmath=True)(kernels.paged_attention.py_func)
    serial_silu = njit(nogil=True, fastmath=True)(kernels.silu_mul.py_func)
    kernels.warm_up()
    rng = np.random.default_rng(0)
    print(f"load average at start: {os.getloadavg()}")
    cases: list[tuple[str, Callable[..., None], Callable[..., None], tuple[Any, ...], int]] = [
        (
            "attention, 16 decode rows",
            serial_attention,
            kernels.paged_attention,
            attention_args(16, False, rng),
            50,
        ),
        (
            "attention, 512-row prefill",
            serial_attention,
            kernels.paged_attention,
            attention_args(512, True, rng),
            5,
        ),
    ]
    gate_up = rng.standard_normal((512, 3072), dtype=np.float32)
    silu_args = (gate_up, np.empty((512, 1536), np.float32))
    cases.append(("SwiGLU, 512 rows", serial_silu, kernels.silu_mul, silu_args, 10))
    print("| case | serial ms | parallel ms |\n| --- | ---: | ---: |")
    for name, serial, parallel, args, reps in cases:
        for _ in range(3):
            print(
                f"| {name} | {median_ms(serial, args, reps):.2f} "
                f"| {median_ms(parallel, args, reps):.2f} |"
            )
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
