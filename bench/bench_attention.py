"""Decode attention at depth: the kernel against its bandwidth floor, A/B, and a whole step.

    python bench/bench_attention.py --shape qwen1.5b --depths 4096,16384
    python bench/bench_attention.py --shape qwen1.5b --depths 4096,16384 --baseline main
    NUMBA_NUM_THREADS=1 python bench/bench_attention.py --cpu --baseline main
    python bench/bench_attention.py --model FILE.gguf --step --depths 0,4096,16384
    python bench/bench_attention.py --model FILE.gguf --step --profile --baseline main
    python bench/bench_attention.py --wake

- **kernel** (the default): one decode row at depth D against every layer's own
  pool (28 pools for the 1.5B, 460 MB of f16 at 16k: K/V come from memory, as in
  a real step), the step's attention = the sum over layers. Beside it the floor:
  the K/V bytes over the machine's streaming read bandwidth (measured here).
- ``--baseline REV``: the same, alternating (each round runs both, the order
  flipped every round) with ``src/triollm/model/attention.py`` as of git
  revision REV, loaded from a temporary file. Revisions before the plan
  (``plan_attention``) stored K position-major, and revisions before V's panels
  (``_values_in_place``) stored V position-major; their pools are laid out so
  (a copy of the same values).
- ``--step`` with ``--model``: the whole batch-1 decode step of the real model at
  depth D over random K/V (normal values, stored in the cache's type). The
  difference to depth 0 is what depth costs the step.
- ``--cpu``: the kernel mode's figures in the process's CPU time, which a busy
  machine distorts less than wall time (with ``NUMBA_NUM_THREADS=1``: one
  thread's work, the kernel's cost without the split across cores).
- ``--wake``: what a parallel region costs here against a tile's work, the two
  numbers behind ``attention.PARALLEL_MIN_WORK`` (``--crossover`` times a
  whole layer both ways).

Every figure is a median over ``--reps``; the load average is printed with it.
The machine is shared: only same-run ratios (A/B) mean anything on a busy one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from triollm.model import attention, kernels
from triollm.model.kvstore import STORAGE, KVDtype, PagedKVCache
from triollm.model.synthetic import measure_bandwidth

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # positions per block, the server's default

# (layers, query heads, KV heads, head_dim) of the files the peers benchmark runs
SHAPES = {
    "qwen1.5b": (28, 12, 2, 128),
    "qwen0.5b": (24, 14, 2, 64),
    "smollm2-135m": (30, 9, 3, 64),
}


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def baseline_module(rev: str) -> ModuleType:
    """``attention.py`` as of ``rev``, imported from a temporary file (numba caches
    its compiled code beside that file)."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/triollm/model/attention.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    where = Path(tempfile.gettempdir()) / "triollm-attention-baseline"
    where.mkdir(exist_ok=True)
    path = where / f"attention_{sha}.py"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"attention_{sha}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's disk cache finds its functions by module name
    spec.loader.exec_module(module)
    return module


class Pools:
    """Every layer's pool for one sequence of ``depth + 1`` positions, random K/V."""

    def __init__(self, shape: tuple[int, int, int, int], depth: int, dtype: KVDtype) -> None:
        layers, n_heads, n_kv, hd = shape
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, hd
        n_blocks = -(-(depth + 1) // BLOCK)
        config_like = _config(shape)
        rng = np.random.default_rng(0)
        self.kv = PagedKVCache(config_like, n_blocks, BLOCK, dtype)
        # K transposed within a block since the plan; position-major before (an
        # older tree on PYTHONPATH, for --step A/B runs). V in panels of 32 columns
        # (a 6-D pool) since V is read in place, position-major before.
        k_axes = (0, 2, 3, 1) if hasattr(self.kv, "position") else (0, 2, 1, 3)
        v_panels = self.kv.v.ndim == 6
        for layer in range(layers):
            for pool, scales, axes in (
                (self.kv.k, self.kv.k_scale, k_axes),
                (self.kv.v, self.kv.v_scale, k_axes if v_panels else (0, 2, 1, 3)),
            ):
                x = rng.standard_normal((n_blocks * BLOCK, n_kv, hd), np.float32)
                values, s = self.kv.encode(x)
                by_block = values.reshape(n_blocks, BLOCK, n_kv, hd)
                if pool is self.kv.v and v_panels:  # (blocks, n_kv, hd / 32, BLOCK, 32)
                    pool[layer] = _panels(by_block.transpose(0, 2, 1, 3))
                else:
                    pool[layer] = by_block.transpose(axes)
                if s is not None:
                    scales[layer] = s.reshape(n_blocks, BLOCK, n_kv, -1).transpose(axes)
        self.depth = depth
        self.table = np.arange(n_blocks, dtype=np.int64).reshape(1, n_blocks)
        self.q = rng.standard_normal((1, n_heads, hd), np.float32)
        self.positions = np.array([depth], np.int64)
        self.chunk = np.zeros(1, np.int64)
        self.out = np.empty_like(self.q)
        self.bytes = int(layers * (depth + 1) * n_kv * hd * 2 * np.dtype(STORAGE[dtype]).itemsize)
        self._old: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._position_major: tuple[np.ndarray, np.ndarray] | None = None

    def old_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The same K in the position-major layout of revisions before the plan."""
        if self._old is None and not hasattr(self.kv, "position"):  # an older tree's pool
            self._old = (self.kv.k, self.kv.v, self.kv.k_scale, self.kv.v_scale)
        if self._old is None:
            k = np.ascontiguousarray(self.kv.k.transpose(0, 1, 2, 4, 3))
            ks = self.kv.k_scale
            if ks.shape[-1] != 1 or ks.shape[-2] != 1:
                ks = np.ascontiguousarray(ks.transpose(0, 1, 2, 4, 3))
            v, vs = self.position_major_values()
            self._old = (k, v, ks, vs)
        return self._old

    def position_major_values(self) -> tuple[np.ndarray, np.ndarray]:
        """V (and q8_0's V scales) as revisions before V's panels stored them:
        ``(layers, blocks, n_kv, BLOCK, head_dim)`` and ``(..., BLOCK, head_dim / 32)``."""
        v, vs = self.kv.v, self.kv.v_scale
        if v.ndim == 5:  # an older tree's pool: position-major already
            return v, vs
        if self._position_major is None:
            lay, nb, n_kv, nvp, bs, width = v.shape
            flat = v.transpose(0, 1, 2, 4, 3, 5).reshape(lay, nb, n_kv, bs, nvp * width)
            v_pm = np.ascontiguousarray(flat[..., : self.hd])
            if vs.shape[-1] != 1 or vs.shape[-2] != 1:
                vs = np.ascontiguousarray(vs.transpose(0, 1, 2, 4, 3))
            self._position_major = (v_pm, vs)
        return self._position_major

    def run(self, module: ModuleType, clock: Any = time.perf_counter) -> float:
        """Seconds of one decode step's attention: every layer, one plan (``clock``:
        wall time, or ``time.process_time`` for the process's CPU time)."""
        new = hasattr(module, "plan_attention")
        k, v, ks, vs = (
            (self.kv.k, self.kv.v, self.kv.k_scale, self.kv.v_scale) if new else self.old_layout()
        )
        if new and not hasattr(module, "_values_in_place"):  # V position-major
            v, vs = self.position_major_values()
        t = clock()
        extra: tuple[Any, ...] = ()
        if new:
            extra = (
                module.plan_attention(
                    self.positions, self.chunk, 0, self.n_kv, self.n_heads, self.hd
                ),
            )
        for layer in range(k.shape[0]):
            module.paged_attention(
                self.q,
                k[layer],
                v[layer],
                self.positions,
                self.chunk,
                self.table,
                0,
                np.float32(0.088),
                self.out,
                ks[layer],
                vs[layer],
                *extra,
            )
        return clock() - t


def _panels(v: np.ndarray) -> np.ndarray:
    """Position-major V ``(blocks, n_kv, bs, hd)`` -> the pool's panels ``(blocks,
    n_kv, hd / 32, bs, 32)``, padding columns zero."""
    nb, n_kv, bs, hd = v.shape
    nvp = -(-hd // 32)
    padded = np.zeros((nb, n_kv, bs, nvp * 32), v.dtype)
    padded[..., :hd] = v
    return padded.reshape(nb, n_kv, bs, nvp, 32).transpose(0, 1, 3, 2, 4)


def _config(shape: tuple[int, int, int, int]) -> Any:
    from triollm.model.config import ModelConfig

    layers, n_heads, n_kv, hd = shape
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": n_heads * hd,
            "intermediate_size": 8,
            "num_hidden_layers": layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv,
            "head_dim": hd,
            "vocab_size": 8,
            "max_position_embeddings": 1 << 20,
        },
        source="<bench>",
    )


def median_ms(f: Any, reps: int) -> tuple[float, list[float]]:
    f()  # warm: compile or load, caches
    times = [f() * 1e3 for _ in range(reps)]
    return statistics.median(times), times


def kernel_mode(args: argparse.Namespace, shape: tuple[int, int, int, int]) -> None:
    dtype = KVDtype(args.kv_dtype)
    best, _ = measure_bandwidth(gib=0.5, reps=5)
    print(f"# decode attention, shape {shape} (layers, heads, kv heads, head_dim), {dtype.value}")
    print(f"# streaming read bandwidth (best of 5): {best / 1e9:.1f} GB/s; load {load_average()}")
    clock = time.process_time if args.cpu else time.perf_counter
    if args.cpu:
        print("# ms are the process's CPU time (with NUMBA_NUM_THREADS=1: one thread's)")
    impls: list[tuple[str, ModuleType]] = [("this tree", attention)]
    if args.baseline:
        impls.append((f"baseline {args.baseline}", baseline_module(args.baseline)))
    print("| depth | impl | round | ms per step (all layers) | floor ms | x floor | load |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for depth in args.depths:
        pools = Pools(shape, depth, dtype)
        floor = pools.bytes / best * 1e3
        per: dict[str, list[float]] = {name: [] for name, _ in impls}
        for rnd in range(args.rounds):
            order = impls if rnd % 2 == 0 else impls[::-1]
            for name, module in order:
                ms, _ = median_ms(lambda m=module, p=pools: p.run(m, clock), args.reps)
                per[name].append(ms)
                print(
                    f"| {depth} | {name} | {rnd + 1} | {ms:.2f} | {floor:.2f} "
                    f"| {ms / floor:.1f} | {load_average()} |",
                    flush=True,
                )
        if len(impls) == 2:
            a, b = per[impls[0][0]], per[impls[1][0]]
            ratios = ", ".join(f"{y / x:.2f}" for x, y in zip(a, b, strict=True))
            print(f"# depth {depth}: baseline / this tree per round: {ratios}")


def step_mode(args: argparse.Namespace) -> None:
    from triollm.model.loader import load_model
    from triollm.plan import ChunkPlan

    dtype = KVDtype(args.kv_dtype)
    loaded = load_model(args.model)
    model = loaded.model
    c = model.config
    shape = (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    # the step's attention is whatever kernels.paged_attention is when llama.py calls
    # it: --baseline swaps in the old module's (its pools are laid out as this tree's)
    impls: list[tuple[str, Any]] = [("this tree", attention)]
    if args.baseline:
        impls.append((f"baseline {args.baseline}", baseline_module(args.baseline)))
    saved = (kernels.plan_attention, kernels.paged_attention)
    print(f"# whole decode step, {Path(args.model).name}, shape {shape}, {dtype.value}")
    if args.profile:
        print(
            "# per stage: wall ms / the process's CPU ms (both threads), mean of --reps "
            "steps; rest = the step minus attention and the weight products"
        )
        print(
            "| depth | impl | round | ms per step | attention | weight products | rest "
            "| step CPU ms | load |"
        )
        print("| ---: | --- | ---: | ---: | --- | --- | --- | ---: | --- |")
    else:
        print("| depth | impl | round | ms per step | attention ms (kernel mode) | load |")
        print("| ---: | --- | ---: | ---: | ---: | --- |")
    try:
        for depth in args.depths:
            pools = Pools(shape, depth + 1, dtype)  # room for the step's own position
            table = tuple(int(b) for b in pools.table[0])
            plan = [ChunkPlan(0, (11,), depth, table, True, False)]
            for rnd in range(args.rounds):
                for name, module in impls if rnd % 2 == 0 else impls[::-1]:
                    kernels.plan_attention = module.plan_attention
                    kernels.paged_attention = module.paged_attention
                    if args.profile:
                        got = _profile_step(model, plan, pools.kv, args.reps)
                        wall, cpu = got["step"]
                        cells = " | ".join(
                            f"{got[k][0]:.1f} / {got[k][1]:.1f}"
                            for k in ("attention", "products", "rest")
                        )
                        print(
                            f"| {depth} | {name} | {rnd + 1} | {wall:.1f} | {cells} | {cpu:.1f} "
                            f"| {load_average()} |",
                            flush=True,
                        )
                        continue
                    step_ms, _ = median_ms(
                        lambda c=plan, p=pools: _timed(model.forward, c, p.kv), args.reps
                    )
                    att_ms, _ = median_ms(lambda p=pools, m=module: p.run(m), args.reps)
                    print(
                        f"| {depth} | {name} | {rnd + 1} | {step_ms:.1f} | {att_ms:.2f} "
                        f"| {load_average()} |",
                        flush=True,
                    )
    finally:
        kernels.plan_attention, kernels.paged_attention = saved


def _profile_step(model: Any, chunks: Any, kv: Any, reps: int) -> dict[str, tuple[float, float]]:
    """Mean (wall ms, process CPU ms) per step of attention, the weight products and
    the rest, by wrapping the module attributes llama.py calls (~1 us per call)."""
    from triollm.model import llama

    totals = {"attention": [0.0, 0.0], "products": [0.0, 0.0]}
    saved = [(kernels, "plan_attention"), (kernels, "paged_attention"), (llama, "linear")]
    originals = [getattr(m, n) for m, n in saved]

    def wrap(fn: Any, stage: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                totals[stage][0] += time.perf_counter() - t
                totals[stage][1] += time.process_time() - c

        return timed

    model.forward(chunks, kv)  # warm
    for (module, name), fn in zip(saved, originals, strict=True):
        setattr(module, name, wrap(fn, "products" if name == "linear" else "attention"))
    try:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(reps):
            model.forward(chunks, kv)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        for (module, name), fn in zip(saved, originals, strict=True):
            setattr(module, name, fn)
    out = {k: (v[0] / reps * 1e3, v[1] / reps * 1e3) for k, v in totals.items()}
    step = (wall / reps * 1e3, cpu / reps * 1e3)
    out["rest"] = (
        step[0] - out["attention"][0] - out["products"][0],
        step[1] - out["attention"][1] - out["products"][1],
    )
    out["step"] = step
    return out


def _timed(f: Any, *a: Any) -> float:
    t = time.perf_counter()
    f(*a)
    return time.perf_counter() - t


def wake_mode(args: argparse.Namespace) -> None:
    """A parallel region that does nothing, and one tile's work, on this machine."""
    from numba import njit, prange

    @njit(parallel=True, nogil=True)
    def empty(a: Any) -> None:  # pragma: no cover - numba
        for i in prange(a.shape[0]):
            a[i] += 1.0

    a = np.zeros(2, np.float64)
    region_ms, _ = median_ms(lambda: _timed(empty, a), 2000)
    # one KV head of a decode row (6 query heads x 128), one item (one segment, so
    # the serial driver): 1 tile, then 32; the slope is one tile visit's cost
    one = Pools((1, 6, 1, 128), 31, KVDtype(args.kv_dtype))
    many = Pools((1, 6, 1, 128), 32 * 32 - 1, KVDtype(args.kv_dtype))
    one_ms, _ = median_ms(lambda: one.run(attention), 2000)
    many_ms, _ = median_ms(lambda: many.run(attention), 500)
    print(f"load {load_average()}")
    print(f"empty parallel region: {region_ms * 1e3:.1f} us (median of 2000)")
    print(f"one decode call (plan, item, merge), 1 tile: {one_ms * 1e3:.1f} us")
    print(f"one tile visit (6 x 128): {(many_ms - one_ms) / 31 * 1e3:.2f} us")


def crossover_mode(args: argparse.Namespace, shape: tuple[int, int, int, int]) -> None:
    """One layer's decode attention on one thread and on both, at each depth.

    Between calls the calling thread works alone for ``--gap-us`` (a layer's
    products on a small model run on the calling thread), so the other OpenMP
    worker has gone back to sleep as in a real step, and each parallel call pays
    the wake-up the forward pays. The depth where "both" wins is the crossover
    behind ``attention.PARALLEL_MIN_WORK``.
    """
    dtype = KVDtype(args.kv_dtype)
    _, n_heads, n_kv, hd = shape
    gap_s = args.gap_us * 1e-6

    def spin() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < gap_s:
            pass

    print(f"# one layer's decode attention, shape {shape}, {dtype.value}, gap {args.gap_us} us")
    print(f"# GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}; load {load_average()}")
    print(
        "| depth | work (vectors x head_dim x tiles) | planned | round | one thread us "
        "| both us | load |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for depth in args.depths:
        pools = Pools((1, n_heads, n_kv, hd), depth, dtype)
        plan = attention.plan_attention(pools.positions, pools.chunk, 0, n_kv, n_heads, hd)
        plans = {
            False: dataclasses.replace(plan, parallel=False),
            True: dataclasses.replace(plan, parallel=True),
        }

        def call(parallel: bool, p: Pools = pools, plans: dict[bool, Any] = plans) -> float:
            spin()
            t = time.perf_counter()
            attention.paged_attention(
                p.q,
                p.kv.k[0],
                p.kv.v[0],
                p.positions,
                p.chunk,
                p.table,
                0,
                np.float32(0.088),
                p.out,
                p.kv.k_scale[0],
                p.kv.v_scale[0],
                plans[parallel],
            )
            return time.perf_counter() - t

        for rnd in range(args.rounds):
            got = {}
            for parallel in (False, True) if rnd % 2 == 0 else (True, False):
                got[parallel], _ = median_ms(lambda q=parallel: call(q), args.reps)
            print(
                f"| {depth} | {getattr(plan, 'work', '?')} | "
                f"{'both' if plan.parallel else 'one'} | {rnd + 1} | {got[False] * 1e3:.1f} "
                f"| {got[True] * 1e3:.1f} | {load_average()} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5b")
    p.add_argument("--model", help="a GGUF file: its shape (and --step runs it)")
    p.add_argument("--depths", default="4096,16384", help="decode positions (comma list)")
    p.add_argument("--kv-dtype", default="f16", choices=[d.value for d in KVDtype])
    p.add_argument("--reps", type=int, default=9, help="timed steps per figure")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--baseline", help="git revision of attention.py to A/B against")
    p.add_argument("--step", action="store_true", help="the whole decode step (needs --model)")
    p.add_argument("--wake", action="store_true", help="parallel region vs one tile")
    p.add_argument(
        "--crossover", action="store_true", help="one layer on one thread vs both, per depth"
    )
    p.add_argument("--gap-us", type=float, default=300.0, help="--crossover: work between calls")
    p.add_argument(
        "--cpu", action="store_true", help="kernel mode in process CPU time, not wall time"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="--step: attention, weight products and the rest, wall and CPU ms",
    )
    args = p.parse_args(argv)
    args.depths = [int(d) for d in args.depths.split(",")]
    if hasattr(attention, "plan_attention"):
        kernels.warm_up(KVDtype(args.kv_dtype))
    else:  # an older tree on PYTHONPATH (--step A/B): it compiles every cache type
        kernels.warm_up()
    if args.wake:
        wake_mode(args)
        return 0
    if args.step:
        if not args.model:
            p.error("--step needs --model")
        step_mode(args)
        return 0
    shape = SHAPES[args.shape]
    if args.model:
        from triollm.model.gguf import GGUFFile

        c = GGUFFile(Path(args.model)).config()
        shape = (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    if args.crossover:
        crossover_mode(args, shape)
        return 0
    kernel_mode(args, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
