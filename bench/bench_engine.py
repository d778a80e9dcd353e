"""Decode and prefill throughput of a SmolLM2-135M-shaped model with random weights.

Run with ``just bench-engine`` (or ``python bench/bench_engine.py --quick``).

The model is built at run time through the real engine (``LlamaModel`` from a
``ModelConfig`` and a weight getter, no directory, nothing downloaded), in
float32 and in bfloat16. For each, the benchmark times ragged decode steps at
batch 1, 4, 8, 16 and 32 (every sequence at its own context length, through the
paged KV cache with trivial block tables) and one 512-token prefill chunk, and
prints a markdown table of medians. It also measures the machine's memory
bandwidth (a large streaming read, best of several) and prints the bandwidth
floor of a decode step, ``(W + B*A) / beta``: W the weight bytes a step reads,
A the KV bytes one sequence reads, beta the bandwidth.

The machine is shared: every figure is a median over repetitions, ratios are
taken within one run, and the load average is printed with the results.
``--profile`` adds a per-stage breakdown (each kind of weight product with its
bytes and GB/s, attention, norms, the rest; wall and the calling thread's CPU) by
timing the engine's calls from outside; ``--compile`` measures
numba's first-compile and cached-load times in fresh subprocesses;
``--serial-max-bytes 0,2097152,rule`` times each case under each threshold of
``threads.SERIAL_MAX_BYTES`` (which one-row products stay on the calling
thread; ``rule``: each path's break-even, ``threads.split_pays``, the default),
alternating inside one process, ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np

from triollm.bench.compare import ENGINE_METRICS, ratio_table, read_jsonl, width_class
from triollm.model import kernels, llama, matmul
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel, PagedKVCache
from triollm.model.synthetic import (  # the random-weight model and the probe
    SMOLLM2_135M,
    _stream_sum,
    decode_weight_bytes,
    measure_bandwidth,
    random_weights,
)
from triollm.plan import ChunkPlan

BLOCK_SIZE = 32


# --- steps -------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str  # "decode" | "prefill"
    batch: int  # sequences in the step
    rows: int  # rows computed per step
    tokens_per_step: int  # tokens the step produces (decode) or consumes (prefill)
    context: int  # mean context positions attended per sequence


def decode_plan(batch: int, context: int) -> tuple[list[ChunkPlan], int]:
    """A ragged decode step: sequence i sits at its own position around ``context``."""
    chunks = []
    next_block = 0
    for i in range(batch):
        start = context - context // 2 + (i * 37) % max(context, 1)  # ragged positions
        n_blocks = start // BLOCK_SIZE + 1
        table = tuple(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        chunks.append(ChunkPlan(i, (7 + i,), start, table, sample=True, prefill=False))
    return chunks, next_block


def prefill_plan(tokens: int) -> tuple[list[ChunkPlan], int]:
    n_blocks = -(-tokens // BLOCK_SIZE)
    ids = tuple(int(t) for t in np.arange(tokens) % 1000 + 10)
    return [ChunkPlan(0, ids, 0, tuple(range(n_blocks)), sample=True, prefill=True)], n_blocks


def thread_sleeps() -> int:
    """Times any thread of this process has blocked so far (voluntary context switches).

    A passive OpenMP worker blocks on a futex after every parallel region and the
    calling thread often does at the region's end, so sleeps per step count what
    the step pays in wake-ups (about two per region; docs/engine.md, "The step's
    fixed costs"). Linux only; 0 elsewhere.
    """
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
        except OSError:  # the thread ended meanwhile
            continue
    return total


def time_steps(
    model: LlamaModel, chunks: list[ChunkPlan], kv: PagedKVCache, reps: int, warmup: int = 2
) -> tuple[list[float], list[float], float]:
    """Wall seconds and process CPU seconds (all threads) of each timed step, and
    the threads' sleeps per step (:func:`thread_sleeps`).

    On a shared machine the wall time includes waiting for a core; the CPU
    time does not (passive OpenMP waiting burns none), so CPU / threads is
    what the step would take with the cores to itself (docs/performance.md).
    """
    for _ in range(warmup):
        model.forward(chunks, kv)
    wall, cpu = [], []
    slept = thread_sleeps()
    for _ in range(reps):
        c = time.process_time()
        t = time.perf_counter()
        model.forward(chunks, kv)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu, (thread_sleeps() - slept) / reps


def sweep_serial(
    model: LlamaModel,
    chunks: list[ChunkPlan],
    kv: PagedKVCache,
    reps: int,
    values: list[int | None],
    rounds: int,
) -> dict[int | None, list[tuple[float, float, float]]]:
    """Time the same step under each ``threads.SERIAL_MAX_BYTES`` in ``values``, alternating.

    ``None`` is the default rule (each product path's break-even,
    ``threads.split_pays``); a byte count overrides it for every path.

    Round ``r`` runs the values in order, reversed when ``r`` is odd, so a drift in
    the machine's load (or a warm cache) favours no value. Returns, per value, one
    ``(median wall s, median CPU s, sleeps per step)`` a round. Inside one process:
    the weights, the numba cache and the page cache are the same for every value,
    which separate processes cannot promise. The setting is restored afterwards.
    """
    from triollm.model import threads

    saved = threads.SERIAL_MAX_BYTES
    out: dict[int | None, list[tuple[float, float, float]]] = {v: [] for v in values}
    try:
        for r in range(rounds):
            for v in values if r % 2 == 0 else values[::-1]:
                threads.SERIAL_MAX_BYTES = v
                wall, cpu, sleeps = time_steps(model, chunks, kv, reps)
                out[v].append((statistics.median(wall), statistics.median(cpu), sleeps))
    finally:
        threads.SERIAL_MAX_BYTES = saved
    return out


# --- per-stage profile -------------------------------------------------------


@contextmanager
def stage_timer(
    totals: dict[str, list[float]],
    kinds: dict[int, str] | None = None,
    model: LlamaModel | None = None,
) -> Iterator[None]:
    """Time the engine's calls by stage, by wrapping the functions llama.py calls.

    llama.py reaches its kernels through module attributes (``kernels.rope_qk``,
    ``linear``), so wrapping those attributes times every call without editing
    the engine. Each stage accumulates ``[wall s, calling thread's CPU s, calls]``;
    a weight product is booked under its kind (``kinds``: ``id(weight)`` -> name,
    :func:`product_kinds`). The wrappers cost ~1 us per call; the profile says so.
    Hazard: the calling thread's CPU time misses a split product's worker share, and
    on a busy machine wall time includes waiting for a core; CPU does not.
    """
    saved: list[tuple[Any, str, Any]] = []
    kinds = kinds or {}

    def book(stage: str, t: float, c: float) -> None:
        acc = totals.setdefault(stage, [0.0, 0.0, 0.0])
        acc[0] += time.perf_counter() - t
        acc[1] += time.thread_time() - c
        acc[2] += 1

    def wrap(module: Any, name: str, stage: str) -> None:
        fn = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                book(stage, t, c)

        saved.append((module, name, fn))
        setattr(module, name, timed)

    def wrap_linear() -> None:
        fn = llama.linear

        def timed(x: Any, w: Any, *args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(x, w, *args, **kwargs)
            finally:
                book("product " + kinds.get(id(w), "other"), t, c)

        saved.append((llama, "linear", fn))
        llama.linear = timed  # type: ignore[assignment]

    wrap_linear()
    wrap(kernels, "plan_attention", "attention (kernels.paged_attention)")
    wrap(kernels, "paged_attention", "attention (kernels.paged_attention)")
    wrap(kernels, "store_kv", "KV write (kernels.store_kv)")
    wrap(kernels, "write_kv", "KV write, q8_0 (kernels.write_kv)")
    wrap(kernels, "rope_qk", "RoPE (kernels.rope_qk)")
    if hasattr(kernels, "qkv_rope_store"):  # not in trees before it (an A/B's old side)
        wrap(kernels, "qkv_rope_store", "q/k/v split, RoPE, KV write (kernels.qkv_rope_store)")
    wrap(kernels, "rms_norm", "RMSNorm (kernels.rms_norm, add_rms_norm)")  # the latter: older trees
    if hasattr(kernels, "add_rms_norm"):
        wrap(kernels, "add_rms_norm", "RMSNorm (kernels.rms_norm, add_rms_norm)")
    wrap(kernels, "silu_mul", "SwiGLU (kernels.silu_mul)")
    if model is not None and hasattr(model, "_activation"):
        # the model binds its activation at load (SwiGLU's silu_mul, Gemma's GELU), so
        # the module attribute's wrapper above never sees the forward's calls
        wrap(model, "_activation", "SwiGLU (kernels.silu_mul)")
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def product_kinds(model: LlamaModel) -> tuple[dict[int, str], dict[str, int]]:
    """``id(weight)`` -> product kind, and each kind's weight bytes read per step."""
    kinds: dict[int, str] = {id(model.lm_head): "lm_head"}
    nbytes: dict[str, int] = {"lm_head": int(model.lm_head.nbytes)}
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w = getattr(layer, name)
            if w is not None:
                kinds[id(w)] = name
                nbytes[name] = nbytes.get(name, 0) + int(w.nbytes)
    return kinds, nbytes


def profile_stages(
    model: LlamaModel, chunks: list[ChunkPlan], kv: PagedKVCache, reps: int
) -> dict[str, tuple[float, float, float, int]]:
    """Per stage: mean (wall s, calling-thread CPU s, calls, weight bytes) per step.

    Each weight product is its own stage ("product qkv_proj", ... "product lm_head").
    'rest' is the step minus the stages: Python between the calls, the embedding,
    the residual adds, the head's gather, and the wrappers' own ~1 us a call.
    """
    totals: dict[str, list[float]] = {}
    kinds, nbytes = product_kinds(model)
    model.forward(chunks, kv)
    with stage_timer(totals, kinds, model):
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            model.forward(chunks, kv)
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
    per = {
        k: (v[0] / reps, v[1] / reps, v[2] / reps, nbytes.get(k.removeprefix("product "), 0))
        for k, v in totals.items()
    }
    rest_w = wall / reps - sum(v[0] for v in per.values())
    rest_c = cpu / reps - sum(v[1] for v in per.values())
    per["rest (Python, embedding, residual adds, head gather)"] = (rest_w, rest_c, 0.0, 0)
    per["step"] = (wall / reps, cpu / reps, 0.0, 0)
    return per


def profile_case(
    model: LlamaModel, chunks: list[ChunkPlan], kv: PagedKVCache, reps: int
) -> dict[str, float]:
    """Mean wall seconds per step in each stage, the products summed into one
    (:func:`profile_stages` has them by kind, with CPU time and bytes)."""
    out: dict[str, float] = {}
    for name, (w, _c, _n, _b) in profile_stages(model, chunks, kv, reps).items():
        key = "weight products (matmul.linear)" if name.startswith("product ") else name
        out[key] = out.get(key, 0.0) + w
    return out


def print_profiles(profiles: list[tuple[str, dict[str, tuple[float, float, float, int]]]]) -> None:
    """One table per profiled case: stage, wall ms, share, CPU ms, calls, MB, GB/s."""
    for title, per in profiles:
        step = per["step"][0]
        print(f"\n{title}: per step (wrappers add ~1 us a call; CPU: the calling thread's)\n")
        print("| stage | wall ms | share | CPU ms | calls | weight MB | GB/s (wall) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, (w, c, n, b) in per.items():
            gbs = f"{b / w / 1e9:.1f}" if b and w > 0 else ""
            mb = f"{b / 1e6:.1f}" if b else ""
            print(
                f"| {name} | {w * 1e3:.2f} | {w / step:.0%} | {c * 1e3:.2f} | "
                f"{n:.0f} | {mb} | {gbs} |"
            )


# --- numba compile / cache-load time -----------------------------------------

_COMPILE_SNIPPET = """
import time, numpy as np
t0 = time.perf_counter()
from triollm.model import matmul, kernels
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel, PagedKVCache
from triollm.plan import ChunkPlan
t_import = time.perf_counter() - t0
cfg = ModelConfig.from_dict(dict(model_type="llama", hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))
from triollm.model.weights import expected_shapes
shapes = expected_shapes(cfg)
def get(key, dtype):
    a = np.full(shapes[key], 0.01, np.float32)
    return (a.view(np.uint32) >> np.uint32(16)).astype(np.uint16) if dtype == "bf16" else a
t1 = time.perf_counter()
for dtype in ("f32", "bf16"):
    m = LlamaModel(cfg, lambda k: get(k, dtype))
    kv = PagedKVCache(cfg, 4, 32)
    m.forward([ChunkPlan(0, (1, 2, 3), 0, (0,), True, True)], kv)
    m.forward([ChunkPlan(0, (4,), 3, (0,), True, False)], kv)
print(f"{t_import:.3f} {time.perf_counter() - t1:.3f}")
"""


def measure_compile() -> tuple[tuple[float, float], tuple[float, float]]:
    """(import, first forward) seconds with an empty numba cache, then with it filled."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        runs = []
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, "-c", _COMPILE_SNIPPET],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            a, b = proc.stdout.split()
            runs.append((float(a), float(b)))
    return runs[0], runs[1]


# --- main --------------------------------------------------------------------


def load_average() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def run(args: argparse.Namespace) -> int:
    config = ModelConfig.from_dict(SMOLLM2_135M, source="SmolLM2-135M shape (built in)")
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [Path(args.model).name] if args.model else args.dtypes.split(",")
    print(f"# triollm bench-engine — {datetime.datetime.now().isoformat(timespec='minutes')}")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}, "
        f"{os.cpu_count()} CPUs, numba threads {numba.get_num_threads()}, "
        f"threading layer {numba.threading_layer() if _touch_parallel() else '?'}"
    )
    print(f"command: python bench/bench_engine.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"load average at start: {load_average()}\n")

    if args.compile:
        (imp0, fwd0), (imp1, fwd1) = measure_compile()
        print("numba kernels (tiny model, f32 + bf16, prefill + decode):")
        print(f"  first run, empty cache: import {imp0:.2f} s, first forwards {fwd0:.2f} s")
        print(f"  second run, cache filled: import {imp1:.2f} s, first forwards {fwd1:.2f} s\n")

    best_bw, med_bw = measure_bandwidth(reps=args.reps)
    print(
        f"memory bandwidth (numba parallel streaming read of 1 GiB): best {best_bw / 1e9:.1f} "
        f"GB/s, median {med_bw / 1e9:.1f} GB/s\n"
    )

    rows_md = []
    records: list[dict[str, Any]] = []  # one JSON line per case (--json, --peer)
    profiles: list[tuple[str, dict[str, tuple[float, float, float, int]]]] = []
    for dtype in dtypes:
        t = time.perf_counter()
        if args.model:  # a real file (GGUF or model directory); "dtype" is its name
            from triollm.model.loader import load_model

            model = load_model(args.model).model
            config = model.config
        else:
            model = LlamaModel(config, random_weights(config, dtype))
        build_s = time.perf_counter() - t
        w_bytes = decode_weight_bytes(model)
        head_params = model.lm_head.in_features * model.lm_head.out_features
        layer_params = sum(
            w.in_features * w.out_features
            for layer in model.layers
            for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        )
        print(
            f"{dtype}: model built in {build_s:.1f} s; a decode step reads "
            f"{w_bytes / 1e6:.0f} MB of weights -> batch-1 floor "
            f"{w_bytes / best_bw * 1e3:.1f} ms/step at {best_bw / 1e9:.1f} GB/s"
        )
        cases: list[tuple[Case, list[ChunkPlan], int]] = []
        for b in batches:
            chunks, nb = decode_plan(b, args.context)
            cases.append((Case("decode", b, b, b, args.context), chunks, nb))
        if args.prefill:
            chunks, nb = prefill_plan(args.prefill)
            cases.append(
                (Case("prefill", 1, args.prefill, args.prefill, args.prefill // 2), chunks, nb)
            )
        base_ms = None
        for case, chunks, nb in cases:
            kv = PagedKVCache(config, nb, BLOCK_SIZE)
            reps = max(3, args.reps // 3) if case.name == "prefill" else args.reps
            if len(args.serial_sweep) > 1:  # an A/B of the threshold instead of the row
                swept = sweep_serial(model, chunks, kv, reps, args.serial_sweep, args.rounds)
                for v, runs in swept.items():
                    per = ", ".join(f"{w * 1e3:.1f} / {c * 1e3:.1f} ({s:.0f})" for w, c, s in runs)
                    label = "rule" if v is None else str(v)
                    print(
                        f"  {case.name:7s} batch {case.batch:3d} serial-max-bytes {label:>10s}: "
                        f"wall / CPU ms (sleeps) per round: {per}",
                        flush=True,
                    )
                print(f"  load {load_average()}", flush=True)
                continue
            times, cpu_times, sleeps = time_steps(model, chunks, kv, reps)
            med = statistics.median(times)
            cpu_med = statistics.median(cpu_times)
            # floor: W once per step, plus each sequence's K/V read once
            # the cache's own element size (f16 by default), not float32's
            ctx_bytes = sum(ch.start + ch.n_rows for ch in chunks) * kv.bytes_per_position
            floor = (w_bytes + ctx_bytes) / best_bw
            # weight-product arithmetic: every layer for every row, the head for sampled rows
            flops = 2 * (layer_params * case.rows + head_params * len(chunks))
            if case.name == "decode" and case.batch == 1:
                base_ms = med
            speedup = (
                f"{(case.batch / med) / (1 / base_ms):.1f}x"
                if case.name == "decode" and base_ms
                else ""
            )
            is_decode = case.name == "decode"
            rows_md.append(
                f"| {dtype} | {case.name} | {case.batch} | {case.rows} | {med * 1e3:.1f} | "
                f"{min(times) * 1e3:.1f} | {cpu_med * 1e3:.1f} | "
                f"{case.tokens_per_step / med:.1f} | {speedup} | {flops / med / 1e9:.0f} | "
                + (f"{floor * 1e3:.1f} | {med / floor:.2f} |" if is_decode else "— | — |")
            )
            records.append(
                {
                    "tool": "bench-engine",
                    "system": args.label,
                    "row": engine_row(case.name, case.batch, case.rows, dtype),
                    "step": case.name,
                    "dtype": dtype,
                    "batch": case.batch,
                    "rows": case.rows,
                    "context": case.context,
                    "ms_step": med * 1e3,
                    "ms_best": min(times) * 1e3,
                    "cpu_ms_step": cpu_med * 1e3,
                    "sleeps_step": sleeps,
                    "tok_s": case.tokens_per_step / med,
                    "floor_ms": floor * 1e3 if is_decode else None,
                    "bandwidth_gbs": best_bw / 1e9,
                    "threads": numba.get_num_threads(),
                    "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "load_avg": list(os.getloadavg()),
                }
            )
            print(
                f"  {case.name:7s} batch {case.batch:3d} rows {case.rows:4d}: median "
                f"{med * 1e3:7.1f} ms/step (CPU {cpu_med * 1e3:.1f} ms, {sleeps:.0f} sleeps), "
                f"{case.tokens_per_step / med:7.1f} tok/s "
                f"(floor {floor * 1e3:.1f} ms, x{med / floor:.2f}) load {load_average()}",
                flush=True,
            )
            if args.profile and (case.name == "prefill" or case.batch in (1, 16)):
                title = f"{dtype} {case.name} batch {case.batch}"
                profiles.append((title, profile_stages(model, chunks, kv, args.profile_reps)))
        del model

    print(f"\nload average at end: {load_average()}\n")
    print(
        "| weights | step | batch | rows | ms/step (median) | ms/step (best) | CPU ms/step | "
        "tok/s | vs batch 1 | GFLOP/s | floor ms | median / floor |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows_md:
        print(r)
    print_profiles(profiles)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    if args.peer:
        peer = read_jsonl(args.peer)
        name = peer[0].get("system", "peer") if peer else "peer"
        print(f"\nside by side with {args.peer} (ours / {name}):\n")
        print(ratio_table(records, peer, ENGINE_METRICS, ours_name=args.label, peer_name=name))
    return 0


def engine_row(step: str, batch: int, rows: int, dtype: str) -> str:
    """The row name both sides of a comparison use (``triollm.bench.compare``)."""
    if step == "decode":
        return f"decode b={batch} {width_class(dtype)}"
    return f"prefill {rows} {width_class(dtype)}"


def _touch_parallel() -> bool:
    """numba reports its threading layer only after a parallel kernel ran."""
    _stream_sum(np.ones((2, 16), np.float32))
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--reps", type=int, default=15, help="timed steps per case (default 15)")
    p.add_argument("--batches", default="1,4,8,16,32", help="decode batch sizes")
    p.add_argument("--prefill", type=int, default=512, help="prefill chunk tokens (0: skip)")
    p.add_argument("--context", type=int, default=256, help="mean decode context positions")
    p.add_argument("--dtypes", default="f32,bf16", help="weight formats: f32,bf16")
    p.add_argument("--model", help="a real model (GGUF file or directory) instead of --dtypes")
    p.add_argument(
        "--threads", type=int, default=0, help="numba threads (default: numba's own, = cores)"
    )
    p.add_argument(
        "--blas-min-rows",
        type=int,
        default=0,
        help="rows from which weight products use BLAS (default: never, the numba kernel)",
    )
    p.add_argument(
        "--serial-max-bytes",
        default=None,
        help="one-row products of weights up to this many bytes run on the calling thread, "
        "whatever their path (default, or 'rule': each path's break-even, "
        "threads.split_pays; 0: every product opens a parallel region); several, "
        "comma-separated, time each case under each value, alternating (--rounds)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of a --serial-max-bytes sweep (default 3)"
    )
    p.add_argument("--profile", action="store_true", help="per-stage time breakdown")
    p.add_argument("--profile-reps", type=int, default=20, help="steps a --profile averages")
    p.add_argument("--compile", action="store_true", help="numba compile and cache-load times")
    p.add_argument("--json", help="append one JSON line per case to this file")
    p.add_argument(
        "--peer", type=Path, help="a peer's results (JSON lines): print ours / peer per row"
    )
    p.add_argument("--label", default="triollm", help="this system's name in --json records")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 5)
    if args.blas_min_rows:
        matmul.BLAS_MIN_ROWS = args.blas_min_rows
    if args.threads:
        numba.set_num_threads(args.threads)
    args.serial_sweep = []
    if args.serial_max_bytes is not None:
        from triollm.model import threads  # here: a tree from before it has no such module

        try:
            args.serial_sweep = [
                None if v.strip() == "rule" else int(v) for v in args.serial_max_bytes.split(",")
            ]
        except ValueError:
            p.error(
                "--serial-max-bytes: integers or 'rule', comma-separated, "
                f"got {args.serial_max_bytes!r}"
            )
        if any(v is not None and v < 0 for v in args.serial_sweep):
            p.error("--serial-max-bytes: byte counts must be >= 0")
        threads.SERIAL_MAX_BYTES = args.serial_sweep[0]
    for d in args.dtypes.split(","):
        if d not in ("f32", "bf16"):
            p.error(f"--dtypes: unknown weight format {d!r} (choose f32, bf16)")
    _ = matmul  # the module under test; imported so a broken kernel fails early
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
