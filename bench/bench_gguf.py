"""triollm's side of the GGUF comparison: the peer's workloads, in process, on a GGUF file.

    python bench/bench_gguf.py FILE.gguf --workload decode,prefill,depth --json OUT.jsonl

measures triollm on exactly what ``tools/bench_peers.py`` asks llama.cpp to do, with
2 threads (``--threads``), and appends one JSON line per case:

- ``decode`` = ``llama-batched-bench -npp P -ntg N -npl B``: B sequences each prefill a
  P-token prompt (not timed), then decode N tokens together; tok/s = B * N / the
  decode time (llama.cpp's S_TG). Every sequence feeds a fixed token and every row's
  logits are computed, as the peer does (it samples nothing either). One untimed
  step after the prefill warms the scratch buffers; the N timed steps follow it.
- ``prefill`` = ``llama-bench -p T -n 0``: one T-token prompt from position 0, in
  chunks of triollm's offline prefill chunk (512 tokens, llama.cpp's default
  micro-batch), the time of the whole prompt; tok/s = T / time.
- ``depth`` = ``llama-bench -p 0 -n N -d D``: N decode tokens at batch 1 after a
  D-token context. The context's K/V are random values written straight into the
  cache instead of a D-token prefill (minutes on this machine, and measured by
  ``prefill`` already): a decode step's cost does not depend on the values it reads.

Without ``--workload``, each FILE is decoded at ``--batches`` alternating with
``--llama-batched-bench PATH`` when given (started through the harness's launcher,
``triollm.bench.peerenv``, so the peer runs in its own default environment), and
``--profile`` splits a step into stages. ``tools/bench_peers.py run`` is the
measurement that counts: it guards each round against a busy machine.

    python bench/bench_gguf.py --products

times one SmolLM2-shaped product (576 x 1536) per weight format and row
count (1, 4, 16) on one core (thread CPU time, best of ``--reps``): the
kernels alone, robust to sharing, beside that core's bandwidth floor (the
weight bytes over one thread's streaming read, ``measure_bandwidth``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import decode_plan, profile_case

from triollm.bench import peerenv
from triollm.model.llama import LlamaModel, PagedKVCache
from triollm.model.loader import load_model
from triollm.plan import ChunkPlan
from triollm.sizing import OFFLINE_CHUNK_TOKENS

BLOCK = 32  # positions per KV block
TOKEN = 11  # the token every decode row feeds (llama-batched-bench feeds a fixed one too)


def _table(start: int, n_blocks: int) -> tuple[int, ...]:
    return tuple(range(start, start + n_blocks))


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(int(t) for t in (np.arange(n) * 7 + seed) % 1000 + 100)


def prefill_chunks(model: LlamaModel, kv: PagedKVCache, seqs: list[tuple[int, ...]]) -> None:
    """Prefill each sequence's prompt from position 0 in chunks of the offline chunk size,
    all sequences' chunks in one step (as llama.cpp's batch holds all prompts)."""
    longest = max(len(p) for p in seqs)
    n_blocks = kv.num_blocks // len(seqs)
    for start in range(0, longest, OFFLINE_CHUNK_TOKENS):
        chunks = [
            ChunkPlan(i, p[start : start + OFFLINE_CHUNK_TOKENS], start,
                      _table(i * n_blocks, n_blocks),
                      sample=start + OFFLINE_CHUNK_TOKENS >= len(p), prefill=True)
            for i, p in enumerate(seqs)
            if start < len(p)
        ]  # fmt: skip
        model.forward(chunks, kv)


# CPU seconds (all threads: process_time) of the last decode_case / prefill_case's
# timed part. On a shared machine wall time measures the queue for a core; the CPU
# time of the same steps is stretched far less, so --workload reports both.
last_cpu_s = 0.0


def decode_case(model: LlamaModel, batch: int, prompt: int, new: int) -> float:
    """Seconds for ``new`` decode steps of ``batch`` sequences after a ``prompt``-token
    prefill each (llama-batched-bench's t_tg); tok/s is batch * new / this."""
    n_blocks = -(-(prompt + new + 1) // BLOCK)
    kv = PagedKVCache(model.config, batch * n_blocks, BLOCK)
    prefill_chunks(model, kv, [_prompt(prompt, i) for i in range(batch)])

    def step(pos: int) -> None:
        model.forward(
            [
                ChunkPlan(i, (TOKEN,), pos, _table(i * n_blocks, n_blocks), True, False)
                for i in range(batch)
            ],
            kv,
        )

    step(prompt)  # warm: scratch buffers sized for this batch
    global last_cpu_s
    t, cpu = time.perf_counter(), time.process_time()
    for pos in range(prompt + 1, prompt + 1 + new):
        step(pos)
    wall = time.perf_counter() - t
    last_cpu_s = time.process_time() - cpu
    return wall


def prefill_case(model: LlamaModel, tokens: int) -> float:
    """Seconds to prefill one ``tokens``-token prompt from position 0 (llama-bench -p)."""
    kv = PagedKVCache(model.config, -(-tokens // BLOCK), BLOCK)
    global last_cpu_s
    t, cpu = time.perf_counter(), time.process_time()
    prefill_chunks(model, kv, [_prompt(tokens, 0)])
    wall = time.perf_counter() - t
    last_cpu_s = time.process_time() - cpu
    return wall


def fill_random(kv: PagedKVCache, rng: np.random.Generator) -> bool:
    """Random K/V in every float array of the cache; False if the cache holds anything
    else (a quantized layout random bytes would not model): then prefill for real."""
    arrays = [a for a in vars(kv).values() if isinstance(a, np.ndarray)]
    if not arrays or any(a.dtype.kind != "f" for a in arrays):
        return False
    for a in arrays:
        flat = a.reshape(-1)
        step = 1 << 22
        for i in range(0, flat.size, step):
            flat[i : i + step] = rng.standard_normal(min(step, flat.size - i), np.float32)
    return True


def depth_case(model: LlamaModel, depth: int, new: int) -> tuple[float, bool]:
    """Seconds for ``new`` batch-1 decode steps after a ``depth``-token context
    (llama-bench -d), and whether the context was a real prefill."""
    n_blocks = -(-(depth + new + 1) // BLOCK)
    kv = PagedKVCache(model.config, n_blocks, BLOCK)
    real = not fill_random(kv, np.random.default_rng(0))
    if real:
        prefill_chunks(model, kv, [_prompt(depth, 0)])
    table = _table(0, n_blocks)
    model.forward([ChunkPlan(0, (TOKEN,), depth, table, True, False)], kv)  # warm
    t = time.perf_counter()
    for pos in range(depth + 1, depth + 1 + new):
        model.forward([ChunkPlan(0, (TOKEN,), pos, table, True, False)], kv)
    return time.perf_counter() - t, real


def resident_mb() -> float | None:
    """This process's resident memory (VmRSS, MB), or None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def workload(args: argparse.Namespace, batches: list[int]) -> int:
    """triollm's B side of one round: one JSON line per case (``--json``)."""
    import numba

    parts = set(args.workload.split(","))
    unknown = parts - {"decode", "prefill", "depth"}
    if unknown or len(args.files) != 1:
        raise SystemExit(f"--workload takes one file and decode,prefill,depth (got {unknown})")
    file = args.files[0]
    t, cpu = time.perf_counter(), time.process_time()
    model = load_model(file).model
    load_s, load_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    base = {
        "system": "triollm",
        "tool": "bench/bench_gguf.py",
        "file": file.name,
        "threads": numba.get_num_threads(),
        "load_s": round(load_s, 2),
        "load_cpu_s": round(load_cpu_s, 2),  # all threads: what a busy machine stretches least
        "rss_mb_after_load": resident_mb(),
    }
    records = []

    def emit(rec: dict) -> None:
        rec = (
            base
            | rec
            | {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        )
        records.append(rec)
        print(json.dumps(rec), flush=True)

    if "decode" in parts:
        for b in batches:
            s = decode_case(model, b, args.prompt, args.new)
            emit({"part": "decode", "row": f"decode b={b}", "batch": b, "prompt": args.prompt,
                  "new": args.new, "seconds": s, "tok_s": b * args.new / s,
                  "cpu_ms_per_step": 1e3 * last_cpu_s / args.new})  # fmt: skip
    if "prefill" in parts:
        for tokens in (int(x) for x in args.prefill.split(",")):
            times, cpus = [], []
            for _ in range(args.prefill_reps):
                times.append(prefill_case(model, tokens))
                cpus.append(last_cpu_s)
            s = statistics.median(times)
            emit({"part": "prefill", "row": f"prefill {tokens}", "rows": tokens,
                  "chunk": OFFLINE_CHUNK_TOKENS, "seconds": s, "tok_s": tokens / s,
                  "cpu_s": statistics.median(cpus)})  # fmt: skip
    if "depth" in parts:
        s, real = depth_case(model, args.depth, args.depth_new)
        emit({"part": "depth", "row": f"decode after {args.depth}", "depth": args.depth,
              "new": args.depth_new, "real_prefill": real, "seconds": s,
              "tok_s": args.depth_new / s})  # fmt: skip
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


def llama_round(
    binary: str, gguf: Path, batches: list[int], prompt: int, new: int
) -> dict[int, float]:
    """llama-batched-bench's S_TG per batch, started in its own default environment."""
    ctx = max(batches) * (prompt + new) + 64
    cmd = [
        binary, "-m", gguf, "-t", 2, "-tb", 2, "-c", ctx, "-b", 2048, "-ub", 512,
        "-npp", prompt, "-ntg", new, "-npl", ",".join(map(str, batches)),
        "--output-format", "jsonl",
    ]  # fmt: skip
    done = peerenv.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    out = {}
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{") and "speed_tg" in line:
            rec = json.loads(line)
            out[int(rec["pl"])] = float(rec["speed_tg"])
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
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence (32)")
    p.add_argument("--new", type=int, default=32, help="decode tokens per sequence (32)")
    p.add_argument("--batches", default="1,16", help="decode batches (1,16)")
    p.add_argument("--reps", type=int, default=15, help="--products / --profile steps (15)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    p.add_argument("--profile", action="store_true", help="then a per-stage split of a step")
    p.add_argument("--threads", type=int, default=2, help="numba threads (2)")
    p.add_argument(
        "--workload",
        help="measure only triollm, as the harness's B side: decode,prefill,depth "
        "(tools/bench_peers.py runs this in a child, one per round)",
    )
    p.add_argument("--prefill", default="512,2048", help="--workload prefill: prompt lengths")
    p.add_argument("--prefill-reps", type=int, default=1, help="--workload prefill: reps (1)")
    p.add_argument("--depth", type=int, default=4096, help="--workload depth: context (4096)")
    p.add_argument("--depth-new", type=int, default=32, help="--workload depth: tokens (32)")
    p.add_argument("--json", type=Path, help="--workload: append one JSON line per case")
    args = p.parse_args(argv)
    if args.products:
        return products(args.reps)
    import numba

    numba.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.workload:
        return workload(args, batches)
    loaded = {f: load_model(f) for f in args.files}
    results: dict[tuple[str, str, int], list[float]] = {}
    for rnd in range(args.rounds):
        for f in args.files:
            for system in ("triollm", "llama.cpp"):
                if system == "llama.cpp" and not args.llama_batched_bench:
                    continue
                load = os.getloadavg()[0]
                if system == "triollm":
                    r = {
                        b: b / decode_case(loaded[f].model, b, args.prompt, args.new)
                        for b in batches
                    }
                else:
                    r = llama_round(args.llama_batched_bench, f, batches, args.prompt, args.new)
                for b, tok_s in r.items():
                    results.setdefault((f.name, system, b), []).append(tok_s)
                figures = ", ".join(f"b{b} {t:.1f} tok/s" for b, t in sorted(r.items()))
                print(f"round {rnd} {f.name} {system}: {figures} (load {load:.1f})", flush=True)
    print()
    print("| file | system | batch | decode tok/s (median) | per round |")
    print("| --- | --- | ---: | ---: | --- |")
    for (name, system, b), v in sorted(results.items()):
        per = ", ".join(f"{x:.1f}" for x in v)
        print(f"| {name} | {system} | {b} | {statistics.median(v):.1f} | {per} |")
    print(
        "\nA busy machine makes these figures unreliable: tools/bench_peers.py run guards "
        "each round and marks it busy."
    )
    if args.profile:
        print_profiles(loaded, args.prompt + args.new // 2, args.reps)
    return 0


def print_profiles(loaded: dict, context: int, reps: int) -> None:
    """Per-stage ms of one step, every file at every batch (bench_engine's profile)."""
    columns = []
    for f, model in loaded.items():
        for b in (1, 16):
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
