"""Quantized products, int8 activations against float32 activations, at the 1.5B model's shapes.

Run with ``python bench/bench_quant.py`` (options: ``--help``).

For each weight type it builds the products of ``--layers`` layers of
Qwen2.5-Coder-1.5B (hidden 1536, intermediate 8960: q/k/v 2048 x 1536,
o 1536 x 1536, gate/up 17920 x 1536, down 1536 x 8960), every product a
distinct array of random blocks, so a sweep streams its bytes from memory,
and times one sweep per variant, alternating ``int8 exact int8 exact ...``
(``int8``: the default, ``quant_int8.py``; ``exact``: ``--exact-activations``,
the widening kernels of ``quant.py``). Per round it prints the wall time of
each variant, then medians, the weight bytes per second and the int8
multiply-accumulates per second.

``--model FILE.gguf`` times whole forward passes of a real file instead:
decode steps at batch 1 and 16 and one prefill, the two paths loaded side by
side and alternated round by round (``bench_gguf.py``'s cases).

``--ceiling`` instead measures what one core can do: a loop of independent
``vpdpbusd`` (zmm and ymm) and of ``vfmadd231ps`` zmm in registers, timed in the
thread's CPU time (a shared core stretches wall time), so the
products can be put beside the instruction's throughput, and a memory
read rate (numpy sum over 1 GB, all threads) for the bandwidth floor.

``--tile`` runs the int8 tile alone (the model's own: one x row, four, and for the
K-quants eight and sixteen) over
records that stay in L1/L2: the tile's compute ceiling, no memory traffic.
``--memory`` runs the same one-row tile over records far larger than L3,
beside one thread's streaming read: what the record stream costs.
``--prefetch`` runs the many-row tiles over records from memory with and
without the prefetch of the next group's records, alternating in one process.
``--shape smollm2`` times SmolLM2-135M's products (and its head) instead of
the 1.5B's; ``--threads 1`` gives CPU times that are the work alone.
``--pack`` times the load's repacking of one gate/up matrix per type;
``--stacks`` a fused product in one stacked call against the way before it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from triollm.model import matmul
from triollm.model.quant import QuantizedTensor, QuantType

LAYER = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))
# SmolLM2-135M (hidden 576, intermediate 1536, 3 KV heads of 64): q/k/v 960 x 576,
# o 576 x 576, gate/up 3072 x 576, down 576 x 1536; its tied head 49152 x 576,
# once per model, comes after the layers (--shape smollm2)
SHAPES = {
    "qwen1.5b": (LAYER, ()),
    "smollm2": (((960, 576), (576, 576), (3072, 576), (576, 1536)), ((49152, 576),)),
}


def random_weight(
    kind: QuantType, shape: tuple[int, int], rng: np.random.Generator
) -> QuantizedTensor:
    rows, cols = shape
    nb = cols // kind.block_values
    b = rng.integers(0, 256, (rows, nb, kind.block_bytes), dtype=np.uint8)
    at = {QuantType.Q6_K: (208,), QuantType.Q4_K: (0, 2), QuantType.Q5_K: (0, 2),
          QuantType.Q4_1: (0, 2), QuantType.Q5_1: (0, 2)}.get(kind, (0,))  # fmt: skip
    for k in at:  # sane float16 scales and mins (random bytes could be NaN or Inf)
        v = rng.uniform(0.001, 0.01, (rows, nb)).astype(np.float16)
        b[..., k : k + 2] = v.view(np.uint8).reshape(rows, nb, 2)
    return QuantizedTensor(kind, shape, b.reshape(rows, -1))


def products(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    if args.threads:
        # one thread: its CPU time is the work alone; with two on a shared machine a
        # spinning worker waiting for a descheduled peer adds CPU time too
        import numba

        numba.set_num_threads(args.threads)
    print(f"# load average at start: {os.getloadavg()}")
    print(
        "| type | rows | variant | per-round ms | median ms | weight GB/s | GMAC/s "
        "| CPU ms (all threads) | GMAC per CPU-s |"
    )
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.types.split(","):
        kind = QuantType[name]
        layer, once = SHAPES[args.shape]
        shapes = [*(s for _ in range(args.layers) for s in layer), *once]
        ws = [random_weight(kind, s, rng) for s in shapes]
        variants = {"int8": ws}
        if not args.int8_only:
            variants["exact"] = [w.with_exact_activations() for w in ws]
        nbytes = sum(w.nbytes for w in ws)
        macs = sum(w.shape[0] * w.shape[1] for w in ws)
        for n in (int(r) for r in args.rows.split(",")):
            widths = {s[1] for s in shapes}
            xs = {k: rng.standard_normal((n, k), dtype=np.float32) for k in widths}
            outs = [np.empty((n, w.shape[0]), np.float32) for w in ws]

            def sweep(weights: list[QuantizedTensor], xs=xs, outs=outs) -> tuple[float, float]:
                t, c = time.perf_counter(), time.process_time()
                for w, o in zip(weights, outs, strict=True):
                    matmul.linear(xs[w.shape[1]], w, out=o)
                return time.perf_counter() - t, time.process_time() - c

            for v in variants.values():
                sweep(v)  # compile / warm
            times: dict[str, list[float]] = {v: [] for v in variants}
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, weights in variants.items():
                    wall, used = sweep(weights)
                    times[v].append(wall)
                    cpu[v].append(used)
            for v in variants:
                med = statistics.median(times[v])
                per = " ".join(f"{t * 1e3:.1f}" for t in times[v])
                # CPU time of all threads: robust to a shared machine (wall time is not)
                c_med = statistics.median(cpu[v])
                print(
                    f"| {name} | {n} | {v} | {per} | {med * 1e3:.1f} | "
                    f"{nbytes / med / 1e9:.1f} | {n * macs / med / 1e9:.0f} | "
                    f"{c_med * 1e3:.1f} | {n * macs / c_med / 1e9:.0f} |",
                    flush=True,
                )
    print(f"# load average at end: {os.getloadavg()}")


def _loop_ir(acc: str, fn: str, op: str, chains: int) -> str:
    """IR of ``go(n)``: n iterations of ``chains`` independent accumulations by ``fn``."""
    fma = "fma" in fn
    args = (acc, acc, acc) if fma else (acc, op, op)
    lines = [f"declare {acc} @{fn}({', '.join(args)})", "define i64 @go(i64 %n, i64 %seed) {"]
    lines += ["entry:", "  %s8 = trunc i64 %seed to i8", "  %sf = sitofp i64 %seed to float"]
    lines.append(f"  %v = insertelement {op} undef, {'float %sf' if fma else 'i8 %s8'}, i32 0")
    lines += ["  br label %loop", "loop:", "  %i = phi i64 [0, %entry], [%i1, %loop]"]
    lines += [
        f"  %c{c} = phi {acc} [zeroinitializer, %entry], [%d{c}, %loop]" for c in range(chains)
    ]
    lines += [f"  %d{c} = call {acc} @{fn}({acc} %c{c}, {op} %v, {op} %v)" for c in range(chains)]
    lines += ["  %i1 = add i64 %i, 1", "  %done = icmp eq i64 %i1, %n"]
    lines += ["  br i1 %done, label %end, label %loop", "end:"]
    total = "%d0"
    for c in range(1, chains):
        lines.append(f"  %t{c} = {'fadd' if fma else 'add'} {acc} {total}, %d{c}")
        total = f"%t{c}"
    lines.append(f"  %e = extractelement {acc} {total}, i32 0")
    lines.append(f"  %r = {'fptosi float' if fma else 'sext i32'} %e to i64")
    return "\n".join([*lines, "  ret i64 %r", "}"])


def _loop_rounds(ir_text: str, tm: Any, engines: list[Any], n: int) -> list[float]:
    """Compile a module whose ``go(n, seed)`` runs ``n`` iterations; its thread CPU
    seconds in each of 5 runs. The engine goes into ``engines``: the caller keeps it
    alive while its code may run."""
    import llvmlite.binding as llvm

    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(ir_text), tm)
    engine.finalize_object()
    engines.append(engine)
    go = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(
        engine.get_function_address("go")
    )
    rounds = []
    for _ in range(5):
        t = time.thread_time()  # CPU time: a shared core stretches wall time
        go(n, 3)
        rounds.append(time.thread_time() - t)
    return rounds


def ceiling() -> None:
    """Independent vpdpbusd / FMA chains in registers, one core; and memory read bandwidth."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    loops = {
        "vpdpbusd zmm (64 MAC)": ("<16 x i32>", "llvm.x86.avx512.vpdpbusd.512", "<64 x i8>", 64),
        "vpdpbusd ymm (32 MAC)": ("<8 x i32>", "llvm.x86.avx512.vpdpbusd.256", "<32 x i8>", 32),
        "vfmadd231ps zmm (16 MAC)": ("<16 x float>", "llvm.fma.v16f32", "<16 x float>", 16),
    }
    chains = 12  # independent accumulators: enough to hide the latency
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten()
    )
    engines = []  # kept alive while their code runs
    print("| instruction | per core | MAC/s per core | per-round ms |")
    print("| --- | ---: | ---: | --- |")
    for label, (acc, fn, op, macs) in loops.items():
        n = 20_000_000
        rounds = _loop_rounds(_loop_ir(acc, fn, op, chains), tm, engines, n)
        per_s = n * chains / min(rounds)
        print(
            f"| {label} | {per_s / 1e9:.2f} G/s | {per_s * macs / 1e9:.0f} G | "
            f"{' '.join(f'{r * 1e3:.0f}' for r in rounds)} |"
        )
    a = np.ones(2**28, np.float32)  # 1 GiB
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        rates.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    per = " ".join(f"{r:.1f}" for r in rates)
    print(f"| numpy sum of 1 GiB, one thread | {max(rates):.1f} GB/s best | | {per} |")
    print(f"# load average: {os.getloadavg()}")


def _pipes_ir(extra: str, count: int) -> str:
    """IR of ``go(n)``: n iterations of 8 independent vpdpbusd and ``count`` ``extra`` ops."""
    v16, v64, v32 = "<16 x i32>", "<64 x i8>", "<32 x i16>"
    busd, wssd = "llvm.x86.avx512.vpdpbusd.512", "llvm.x86.avx512.vpdpwssd.512"
    gf = "llvm.x86.vgf2p8affineqb.512"
    lines = [f"declare {v16} @{f}({v16}, {v16}, {v16})" for f in (busd, wssd)]
    lines += [f"declare {v64} @{gf}({v64}, {v64}, i8)", "define i64 @go(i64 %n, i64 %seed) {"]
    lines += [
        "entry:",
        "  %s = trunc i64 %seed to i32",
        f"  %v0 = insertelement {v16} undef, i32 %s, i32 0",
    ]
    lines += [
        f"  %v = shufflevector {v16} %v0, {v16} undef, {v16} zeroinitializer",
        "  br label %loop",
    ]
    lines += ["loop:", "  %i = phi i64 [0, %entry], [%i1, %loop]"]
    chains = [f"b{c}" for c in range(8)] + [f"m{c}" for c in range(count)]
    lines += [f"  %{c} = phi {v16} [%v, %entry], [%{c}n, %loop]" for c in chains]
    lines += [f"  %b{c}n = call {v16} @{busd}({v16} %b{c}, {v16} %v, {v16} %v)" for c in range(8)]
    for c in range(count):
        m = f"%m{c}"
        if extra == "vpmulld":
            lines.append(f"  {m}n = mul {v16} {m}, %v")
        elif extra == "vpdpwssd":
            lines.append(f"  {m}n = call {v16} @{wssd}({v16} {m}, {v16} %v, {v16} %v)")
        elif extra == "vgf2p8affineqb":  # what LLVM makes of a byte shift right by 4 and a mask
            shift = "<8 x i64> <" + ", ".join(["i64 1157442765409226768"] * 8) + ">"
            lines.append(f"  {m}b = bitcast {v16} {m} to {v64}")
            lines.append(
                f"  {m}g = call {v64} @{gf}({v64} {m}b, {v64} bitcast ({shift} to {v64}), i8 0)"
            )
            lines.append(f"  {m}n = bitcast {v64} {m}g to {v16}")
        else:  # vpsrlw + vpandq: the same nibbles by a word shift (quant_int8._shift16)
            lines.append(f"  {m}w = bitcast {v16} {m} to {v32}")
            lines.append(f"  {m}s = lshr {v32} {m}w, <" + ", ".join(["i16 4"] * 32) + ">")
            lines.append(f"  {m}t = bitcast {v32} {m}s to {v16}")
            lines.append(f"  {m}n = and {v16} {m}t, <" + ", ".join(["i32 252645135"] * 16) + ">")
    lines += ["  %i1 = add i64 %i, 1", "  %done = icmp eq i64 %i1, %n"]
    lines += ["  br i1 %done, label %end, label %loop", "end:"]
    total = "%v"
    for k, c in enumerate(chains):
        lines.append(f"  %t{k} = add {v16} {total}, %{c}n")
        total = f"%t{k}"
    lines += [f"  %e = extractelement {v16} {total}, i32 0", "  %r = sext i32 %e to i64"]
    return "\n".join([*lines, "  ret i64 %r", "}"])


def pipes() -> list[object]:
    """Which ops share vpdpbusd's pipes: 8 vpdpbusd chains plus 2 or 4 of another op.

    One core, registers only. An op that runs on the pipes ``vpdpbusd`` needs
    makes the iteration longer by about one ``vpdpbusd`` each; an op on other
    pipes hides behind the eight. On Zen 4: ``vpmulld``, ``vpdpwssd`` and
    ``vgf2p8affineqb`` (LLVM's lowering of a byte shift plus a mask) cost one
    slot each; a 16-bit shift and an AND cost none (docs/engine.md, int8).
    """
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2
    )
    engines = []  # kept alive while their code runs
    print("| 8 vpdpbusd and | ns per iteration (best of 5, thread CPU) | per-round ns |")
    print("| --- | ---: | --- |")
    cases = [("nothing", 0)] + [
        (op, k)
        for op in ("vpmulld", "vpdpwssd", "vgf2p8affineqb", "vpsrlw + vpandq")
        for k in (2, 4)
    ]
    for op, count in cases:
        n = 10_000_000
        rounds = [r / n * 1e9 for r in _loop_rounds(_pipes_ir(op, count), tm, engines, n)]
        label = op if not count else f"{count} x {op}"
        print(f"| {label} | {min(rounds):.2f} | {' '.join(f'{r:.2f}' for r in rounds)} |")
    print(f"# load average: {os.getloadavg()}")
    return engines  # freed with the function's frame, an engine crashed the process


def tile_rate(types: str) -> None:
    """One core, the int8 tile alone on records that sit in L1/L2: its compute ceiling.

    A numba loop calls the tile (the model's own, ``quant_int8._int8_tile``) over
    two groups of a 1536-wide weight (2 x 6 records: 28 KB of Q4_K, 40 KB of Q6_K,
    in L1/L2) again and again, one x row, four, eight and sixteen: no memory traffic, no parallel
    region, no Python. Its rate is what a product could reach if memory were free;
    beside the --ceiling loop, the share of the tile's time that is vpdpbusd.
    """
    import numba
    from numba import njit

    from triollm.model import quant_int8 as qi

    @njit(nogil=True)
    def one_row(kind, q, d, s, packed, out, reps):  # type: ignore[no-untyped-def]
        for _ in range(reps):
            for g in range(packed.shape[0]):
                qi._int8_tile(kind, 1, 0, q, d, s, packed, out, g, 0, 0, 0, out.shape[1])

    @njit(nogil=True)
    def four_rows(kind, q, d, s, packed, out, reps):  # type: ignore[no-untyped-def]
        for _ in range(reps):
            for g in range(packed.shape[0]):
                qi._int8_tile(kind, 4, 0, q, d, s, packed, out, g, 0, 3, 0, out.shape[1])

    @njit(nogil=True)
    def eight_rows(kind, q, d, s, packed, out, reps):  # type: ignore[no-untyped-def]
        for _ in range(reps):
            for g in range(packed.shape[0]):
                qi._int8_tile(kind, 8, 0, q, d, s, packed, out, g, 0, 7, 0, out.shape[1])

    @njit(nogil=True)
    def sixteen_rows(kind, q, d, s, packed, out, reps):  # type: ignore[no-untyped-def]
        for _ in range(reps):
            for g in range(packed.shape[0]):
                qi._int8_tile(kind, 16, 0, q, d, s, packed, out, g, 0, 15, 0, out.shape[1])

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    print("| type | x rows | record bytes | GB/s of records | G vpdpbusd/s | per-round ms |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in types.split(","):
        kind = QuantType[name]
        w = random_weight(kind, (32, 1536), rng)
        packed = w.packed()
        lay = qi.LAYOUTS[int(kind)]
        tiles = [(1, one_row), (4, four_rows)]
        # the types with tiles of eight rows (trees before _EIGHT_TYPES: the K-quants)
        if int(kind) in getattr(qi, "_EIGHT_TYPES", qi._MANY_TYPES):
            tiles.append((8, eight_rows))
        if int(kind) in qi._MANY_TYPES:  # the only types with tiles of sixteen rows
            tiles.append((16, sixteen_rows))
        for n, fn in tiles:
            x = qi.quantize_rows(rng.standard_normal((n, 1536), dtype=np.float32), lay.values)
            out = np.empty((n, 32), np.float32)
            reps = 20000 // n
            fn(int(kind), x.q, x.d, x.sums, packed, out, 10)  # compile
            rounds = []
            for _ in range(5):
                t = time.thread_time()
                fn(int(kind), x.q, x.d, x.sums, packed, out, reps)
                rounds.append(time.thread_time() - t)
            best = min(rounds)
            busd = reps * packed.shape[0] * (1536 // 4) * n  # one per 4 values, group and row
            print(
                f"| {name} | {n} | {lay.size} | {reps * packed.nbytes / best / 1e9:.1f} "
                f"| {busd / best / 1e9:.2f} | {' '.join(f'{r * 1e3:.0f}' for r in rounds)} |",
                flush=True,
            )
    print(f"# load average: {os.getloadavg()}")


def prefetch_ab(types: str, rows: str, rounds: int) -> None:
    """One core, the many-row tiles streaming records from memory, with and without
    the prefetch of the next group's records (``quant_int8._PREFETCH_X``).

    Both variants are compiled in this one process (the tile's IR reads
    ``_PREFETCH_X`` when a caller is compiled; these callers are not cached) and
    alternate round by round over the same weights (~60 MB of records per shape,
    far larger than L3), in the thread's CPU time: an A/B that a shared machine
    disturbs less than two processes would. A driver like the model's: per group,
    every tile of the rows, tallest first. Same bits either way (a hint only).
    """
    import numba
    from numba import njit

    from triollm.model import quant_int8 as qi

    def make():  # type: ignore[no-untyped-def]
        @njit(nogil=True)
        def tiles(kind, q, d, s, packed, out):  # type: ignore[no-untyped-def]
            n = q.shape[0]
            for g in range(packed.shape[0]):
                r0 = 0
                while kind >= 12 and r0 + 16 <= n:  # the K-quants' tile of sixteen
                    qi._int8_tile(kind, 16, 0, q, d, s, packed, out, g, r0, n - 1, 0, out.shape[1])
                    r0 += 16
                while r0 + 8 <= n:
                    qi._int8_tile(kind, 8, 0, q, d, s, packed, out, g, r0, n - 1, 0, out.shape[1])
                    r0 += 8
                while r0 + 4 <= n:
                    qi._int8_tile(kind, 4, 0, q, d, s, packed, out, g, r0, n - 1, 0, out.shape[1])
                    r0 += 4
                while r0 < n:
                    qi._int8_tile(kind, 1, 0, q, d, s, packed, out, g, r0, n - 1, 0, out.shape[1])
                    r0 += 1

        return tiles

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    on = qi._PREFETCH_X
    print(
        "| type | x rows | matrix | MB | G vpdpbusd/s without, per round | with "
        "| median with / without |"
    )
    print("| --- | ---: | --- | ---: | --- | --- | ---: |")
    for name in types.split(","):
        kind = QuantType[name]
        k_quant = kind.block_values == 256
        shapes = (
            [(3072, 1536), (8960, 1536)] if k_quant else [(3072, 576), (48000, 576), (1152, 1536)]
        )
        for n in (int(r) for r in rows.split(",")):
            variants = {}
            for label, px in (("without", 1 << 30), ("with", on)):
                qi._PREFETCH_X = px  # read when the tile's IR is made, at the first call
                try:
                    fn = make()
                    w0 = random_weight(kind, (16, shapes[0][1]), rng)
                    x0 = qi.quantize_rows(np.ones((n, shapes[0][1]), np.float32), kind.block_values)
                    fn(int(kind), x0.q, x0.d, x0.sums, w0.packed(), np.empty((n, 16), np.float32))
                finally:
                    qi._PREFETCH_X = on
                variants[label] = fn
            for m, k in shapes:
                ws = [
                    random_weight(kind, (m, k), rng).packed()
                    for _ in range(max(1, int(60e6 // (m * k))))
                ]
                x = qi.quantize_rows(
                    rng.standard_normal((n, k), dtype=np.float32), kind.block_values
                )
                out = np.empty((n, m), np.float32)
                busd = len(ws) * m * k * n / 64
                got: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(rounds):
                    for label, fn in variants.items():
                        t = time.thread_time()
                        for p in ws:
                            fn(int(kind), x.q, x.d, x.sums, p, out)
                        got[label].append(busd / (time.thread_time() - t) / 1e9)
                ratio = statistics.median(got["with"]) / statistics.median(got["without"])
                per = [" ".join(f"{r:.2f}" for r in got[v]) for v in variants]
                mb = sum(p.nbytes for p in ws) / 1e6
                print(
                    f"| {name} | {n} | {m} x {k} | {mb:.0f} | {per[0]} | {per[1]} | {ratio:.2f} |",
                    flush=True,
                )
    print(f"# load average: {os.getloadavg()}")


def memory_rate(types: str, rounds: int) -> None:
    """One core, the one-row int8 tile over records far larger than L3: from memory.

    The same loop as ``--tile`` (no parallel region, no Python between groups)
    over eight distinct matrices per shape (64-181 MB of records), in the
    thread's CPU time, beside one thread's streaming read of 512 MiB (a float32
    sum, in its CPU time too: wall time on a shared core measures the queue),
    each round taking both. What a product
    loses against that read is the record stream's shape (what the hardware
    prefetcher follows), not the arithmetic (``--tile``: ~60 GB/s a core).
    """
    import numba
    from numba import njit

    from triollm.model import quant_int8 as qi

    @njit(nogil=True, fastmath=True)
    def stream(a):  # type: ignore[no-untyped-def]
        total = np.float32(0.0)
        for i in range(a.shape[0]):
            total += a[i]
        return total

    @njit(nogil=True)
    def one_row(kind, q, d, s, packed, out):  # type: ignore[no-untyped-def]
        for g in range(packed.shape[0]):
            qi._int8_tile(kind, 1, 0, q, d, s, packed, out, g, 0, 0, 0, out.shape[1])

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    big = np.ones(1 << 27, np.float32)  # 512 MiB, every page written (resident)
    stream(big[:1024])
    print("| type | matrix | MB read | GB/s of records, per round | stream read GB/s, per round |")
    print("| --- | --- | ---: | --- | --- |")
    for name in types.split(","):
        kind = QuantType[name]
        for shape in ((17920, 1536), (1536, 8960)):  # the 1.5B's gate/up and down
            ws = [random_weight(kind, shape, rng).packed() for _ in range(8)]
            lay = qi.LAYOUTS[int(kind)]
            x = qi.quantize_rows(rng.standard_normal((1, shape[1]), dtype=np.float32), lay.values)
            out = np.empty((1, shape[0]), np.float32)
            one_row(int(kind), x.q, x.d, x.sums, ws[0], out)  # compile
            nbytes = sum(w.nbytes for w in ws)
            rates, reads = [], []
            for _ in range(rounds):
                t = time.thread_time()
                for w in ws:
                    one_row(int(kind), x.q, x.d, x.sums, w, out)
                rates.append(nbytes / (time.thread_time() - t) / 1e9)
                t = time.thread_time()
                stream(big)
                reads.append(big.nbytes / (time.thread_time() - t) / 1e9)
            per, read = (" ".join(f"{r:.1f}" for r in v) for v in (rates, reads))
            print(f"| {name} | {shape[0]} x {shape[1]} | {nbytes / 1e6:.0f} | {per} | {read} |")
    print(f"# load average: {os.getloadavg()}")


def pack_rate(types: str) -> None:
    """CPU time of the load's repacking (``quant_pack.pack``) of one gate/up matrix per type."""
    from triollm.model import quant_pack

    rng = np.random.default_rng(0)
    print("| type | matrix | MB | best CPU ms (both threads) | GB per CPU-s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in types.split(","):
        w = random_weight(QuantType[name], LAYER[2], rng)
        quant_pack.pack(w.blocks[:16], int(w.qtype))  # compile / load
        best = float("inf")
        for _ in range(3):
            c = time.process_time()
            quant_pack.pack(w.blocks, int(w.qtype))
            best = min(best, time.process_time() - c)
        print(
            f"| {name} | {LAYER[2][0]} x {LAYER[2][1]} | {w.nbytes / 1e6:.1f} | "
            f"{best * 1e3:.0f} | {w.nbytes / best / 1e9:.2f} |"
        )
    print(f"# load average: {os.getloadavg()}")


def stacks(args: argparse.Namespace) -> None:
    """A fused product as one stacked call against the way before it, CPU time per product.

    gate/up (two Q4_K parts) against one concatenated tensor, and a Q4_K_M
    file's q/k/v (Q4_K, Q4_K, Q6_K) against one call per part into a
    temporary and a copy (x quantized once for all parts, as before); ``--layers``
    distinct weights each, alternating old and new ``--rounds`` times.
    """
    from triollm.model import quant_int8
    from triollm.model.quant import QuantizedStack

    rng = np.random.default_rng(0)

    def concat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        b = np.concatenate([p.blocks for p in parts])
        return QuantizedTensor(parts[0].qtype, (b.shape[0], parts[0].shape[1]), b)

    def per_part(x: np.ndarray, parts: tuple[QuantizedTensor, ...]) -> np.ndarray:
        acts = quant_int8.quantize_rows(x, 256)
        out = np.empty((x.shape[0], sum(p.shape[0] for p in parts)), np.float32)
        j = 0
        for p in parts:
            part = np.empty((x.shape[0], p.shape[0]), np.float32)
            quant_int8.product(acts, p.packed(), int(p.qtype), part, 256)
            out[:, j : j + p.shape[0]] = part
            j += p.shape[0]
        return out

    q4, q6 = QuantType.Q4_K, QuantType.Q6_K
    gu = [[random_weight(q4, (8960, 1536), rng) for _ in range(2)] for _ in range(args.layers)]
    qkv = [
        [random_weight(t, (r, 1536), rng) for t, r in ((q4, 1536), (q4, 256), (q6, 256))]
        for _ in range(args.layers)
    ]
    cases = {
        "gate/up, Q4_K + Q4_K": (gu, [concat(p) for p in gu], False),
        "q/k/v, Q4_K + Q4_K + Q6_K": (qkv, [tuple(p) for p in qkv], True),
    }
    for ws, old, _ in cases.values():
        for w in old:
            for p in w if isinstance(w, tuple) else (w,):
                p.packed()
        for parts in ws:
            for p in parts:
                p.packed()
    print(f"# load average at start: {os.getloadavg()}")
    print("| product | rows | before: per-round CPU ms | one stacked call | medians |")
    print("| --- | ---: | --- | --- | --- |")
    for n in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((n, 1536), dtype=np.float32)
        for name, (ws, old, split) in cases.items():
            new = [QuantizedStack(tuple(p)) for p in ws]

            def run_old(x=x, old=old, split=split) -> None:
                for w in old:
                    per_part(x, w) if split else matmul.linear(x, w)

            def run_new(x=x, new=new) -> None:
                for w in new:
                    matmul.linear(x, w)

            run_old()
            run_new()
            got: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.rounds):
                for side, fn in (("old", run_old), ("new", run_new)):
                    c = time.process_time()
                    fn()
                    got[side].append((time.process_time() - c) / len(ws) * 1e3)
            o, w = (" ".join(f"{v:.2f}" for v in got[k]) for k in ("old", "new"))
            med = f"{statistics.median(got['old']):.2f} / {statistics.median(got['new']):.2f}"
            print(f"| {name} | {n} | {o} | {w} | {med} |", flush=True)
    print(f"# load average at end: {os.getloadavg()}")


def model_rounds(args: argparse.Namespace) -> None:
    """Decode b=1, b=16 and a prefill of a real file: int8 and exact alternating."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gguf import decode_case, prefill_case

    from triollm.model.loader import load_model

    models = {
        "int8": load_model(args.model).model,
        "exact": load_model(args.model, exact_activations=True).model,
    }
    print(f"# {args.model}; load average at start: {os.getloadavg()}")
    cases = {
        "decode b=1 (tok/s)": lambda m: 16 / decode_case(m, 1, 32, 16),
        "decode b=16 (tok/s)": lambda m: 16 * 8 / decode_case(m, 16, 32, 8),
        f"prefill {args.prefill} (tok/s)": lambda m: args.prefill / prefill_case(m, args.prefill),
    }
    print("| case | variant | per-round | median | int8 / exact |")
    print("| --- | --- | --- | ---: | ---: |")
    for label, case in cases.items():
        for m in models.values():
            case(m)  # warm
        got: dict[str, list[float]] = {v: [] for v in models}
        for _ in range(args.rounds):
            for v, m in models.items():
                got[v].append(case(m))
        meds = {v: statistics.median(r) for v, r in got.items()}
        for v, r in got.items():
            ratio = f"{meds['int8'] / meds['exact']:.2f}x" if v == "int8" else ""
            per = " ".join(f"{x:.1f}" for x in r)
            print(f"| {label} | {v} | {per} | {meds[v]:.1f} | {ratio} |", flush=True)
    print(f"# load average at end: {os.getloadavg()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0", help="weight types")
    p.add_argument("--rows", default="1,16,512", help="row counts")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (>= 3)")
    p.add_argument("--layers", type=int, default=2, help="layers per sweep (distinct arrays)")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen1.5b",
        help="the products' model shapes (smollm2: its head too)",
    )
    p.add_argument("--threads", type=int, default=0, help="numba threads (default: all)")
    p.add_argument("--int8-only", action="store_true", help="no --exact-activations variant")
    p.add_argument("--ceiling", action="store_true", help="instruction throughput and bandwidth")
    p.add_argument("--pipes", action="store_true", help="which ops share vpdpbusd's pipes")
    p.add_argument("--tile", action="store_true", help="the int8 tile alone on data in L1/L2")
    p.add_argument("--memory", action="store_true", help="the int8 tile on records from memory")
    p.add_argument("--prefetch", action="store_true", help="many-row tiles with/without prefetch")
    p.add_argument("--pack", action="store_true", help="CPU time of the load's repacking")
    p.add_argument("--stacks", action="store_true", help="fused products: one call vs before")
    p.add_argument("--model", help="a GGUF file: whole forward passes instead of products")
    p.add_argument("--prefill", type=int, default=128, help="prefill tokens with --model")
    args = p.parse_args(argv)
    if args.ceiling or args.pipes:
        _kept = pipes() if args.pipes else []  # the engines outlive their code (a segfault)
        if args.ceiling:
            ceiling()
        # Hazard: llvmlite's MCJIT engines crashed the interpreter's teardown
        # (a segfault after the figures); leave without it
        sys.stdout.flush()
        os._exit(0)
    elif args.stacks:
        stacks(args)
    elif args.pack:
        pack_rate(args.types)
    elif args.tile:
        tile_rate(args.types)
    elif args.memory:
        memory_rate(args.types, args.rounds)
    elif args.prefetch:
        prefetch_ab(args.types, args.rows, args.rounds)
    elif args.model:
        model_rounds(args)
    else:
        products(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
