"""The weight products alone: the panel kernel against a baseline kernel and BLAS, per row count.

Run with ``python bench/bench_gemm.py`` (options: ``--help``).

It builds the weight products of one SmolLM2-135M-shaped forward pass (30
layers of q/k/v, o, gate/up and down, plus the tied output head) with random
weights, every product a distinct array, so a sweep reads as many bytes as a
real decode step does (538 MB in f32, 269 MB in bf16) and no weight is still
in a cache from the last product. For each row count it runs the sweep with

- ``panel``: this tree's ``matmul.linear`` (the column-panel kernel);
- ``base``: ``matmul.py`` as it is at a git ref (``--base``, default ``main``),
  loaded from a copy in a temporary directory (never the tree's file under a
  second name: numba's cache would mix the two, docs/performance.md);
- ``blas``: ``np.matmul(x, W.T)`` on float32 ``[out, in]`` copies (OpenBLAS's
  threads; for bf16 the widened weights, so twice the bytes);

alternating ``panel base blas panel base blas ...`` so the shared machine's
drift hits all of them, and prints medians of the wall time per sweep, CPU
time (both threads), GFLOP/s and GB/s of weights, and the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from triollm.model import matmul

ROOT = Path(__file__).resolve().parents[1]
# (out, in) of the products of one SmolLM2-135M layer: qkv, o, gate_up, down
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)
LAYERS = 30


def load_base(ref: str, directory: Path) -> Any:
    """``src/triollm/model/matmul.py`` at git ``ref``, imported from a copy in ``directory``."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:src/triollm/model/matmul.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = directory / "matmul_base.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("matmul_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["matmul_base"] = module
    spec.loader.exec_module(module)
    return module


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return (a.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def build(dtype: str, shapes: list[tuple[int, int]], base: Any, blas: bool) -> dict[str, list]:
    """Per variant, one prepared weight per shape (distinct arrays)."""
    rng = np.random.default_rng(0)
    out: dict[str, list] = {"panel": [], "base": [], "blas": []}
    for n_out, k_in in shapes:
        w = rng.standard_normal((n_out, k_in), dtype=np.float32) * np.float32(0.02)
        raw = bf16_bits(w) if dtype == "bf16" else w
        out["panel"].append(matmul.prepare(raw, bf16=dtype == "bf16"))
        if base is not None:
            out["base"].append(base.prepare(raw, bf16=dtype == "bf16"))
        if blas:
            f32 = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "bf16" else w
            out["blas"].append(np.ascontiguousarray(f32))
    return {k: v for k, v in out.items() if v}


def sweep_fn(variant: str, weights: list, base: Any) -> Callable[[np.ndarray], None]:
    outs: dict[tuple[int, int], np.ndarray] = {}

    def scratch(n: int, m: int) -> np.ndarray:
        if (n, m) not in outs:
            outs[(n, m)] = np.empty((n, m), np.float32)
        return outs[(n, m)]

    def run(xs: dict[int, np.ndarray]) -> None:
        for w in weights:
            if variant == "blas":
                x = xs[w.shape[1]]
                np.matmul(x, w.T, out=scratch(x.shape[0], w.shape[0]))
            else:
                x = xs[w.in_features]
                mod = matmul if variant == "panel" else base
                mod.linear(x, w, out=scratch(x.shape[0], w.out_features))

    return run  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64,512", help="row counts")
    p.add_argument("--dtypes", default="f32,bf16", help="weight formats: f32,bf16")
    p.add_argument("--reps", type=int, default=7, help="timed sweeps per variant and row count")
    p.add_argument("--base", default="main", help="git ref of the baseline matmul.py ('' skips)")
    p.add_argument("--no-blas", action="store_true", help="skip the np.matmul variant")
    p.add_argument("--head", action="store_true", help="also the output head (49152 x 576)")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers in a sweep (default 30)")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for _ in range(args.layers) for s in LAYER] + ([HEAD] if args.head else [])
    params = sum(a * b for a, b in shapes)
    print(f"# bench_gemm: {len(shapes)} products, {params / 1e6:.1f} M weights per sweep")
    print(f"# load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, Path(tmp)) if args.base else None
        print("| weights | rows | variant | ms/sweep (median) | CPU ms | GFLOP/s | GB/s |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
        for dtype in args.dtypes.split(","):
            ws = build(dtype, shapes, base, not args.no_blas)
            nbytes = {
                "panel": sum(w.nbytes for w in ws["panel"]),
                "base": sum(w.nbytes for w in ws.get("base", [])),
                "blas": sum(w.nbytes for w in ws.get("blas", [])),
            }
            runs = {v: sweep_fn(v, ws[v], base) for v in ws}
            rng = np.random.default_rng(1)
            for n in rows:
                xs = {
                    k: rng.standard_normal((n, k), dtype=np.float32) for k in {s[1] for s in shapes}
                }
                for run in runs.values():  # compile / warm up
                    run(xs)
                wall: dict[str, list[float]] = {v: [] for v in runs}
                cpu: dict[str, list[float]] = {v: [] for v in runs}
                for _ in range(args.reps):
                    for v, run in runs.items():
                        c = time.process_time()
                        t = time.perf_counter()
                        run(xs)
                        wall[v].append(time.perf_counter() - t)
                        cpu[v].append(time.process_time() - c)
                for v in runs:
                    med = statistics.median(wall[v])
                    gflops = 2 * n * params / med / 1e9
                    print(
                        f"| {dtype} | {n} | {v} | {med * 1e3:.1f} | "
                        f"{statistics.median(cpu[v]) * 1e3:.1f} | {gflops:.0f} | "
                        f"{nbytes[v] / med / 1e9:.1f} |",
                        flush=True,
                    )
            del ws, runs
    print(f"# load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
