"""Batching: one weight read serves every sequence of a step, so throughput grows with B.

The book's arithmetic (20.3.2): a decode step of batch size B costs about
(W + B·A)/β — W the weight bytes, read once per step whatever B is; A the bytes each
sequence reads for itself (its K/V); β the memory bandwidth. While B·A is small
beside W, B sequences cost little more than one, so tokens per second grow almost
linearly with B; past that, arithmetic or the K/V reads take over.

This builds SmolLM2-135M's shape with random weights (``--layers`` makes it
shallower and quicker), measures β on this machine, then times ragged decode steps
of the real forward pass at each batch size and prints the measured figures beside
the arithmetic's floor. Figures vary from run to run on a shared machine; the shape
does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from triollm.plan import ChunkPlan

BLOCK_SIZE = 32
CONTEXT = 256  # positions each sequence already holds (about)


def decode_plan(batch: int) -> tuple[list[ChunkPlan], int]:
    """One decode row per sequence, each at its own position near ``CONTEXT``."""
    chunks, next_block = [], 0
    for i in range(batch):
        start = CONTEXT - CONTEXT // 2 + (i * 37) % CONTEXT  # ragged positions
        n_blocks = start // BLOCK_SIZE + 1
        table = tuple(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        chunks.append(ChunkPlan(i, (7 + i,), start, table, sample=True, prefill=False))
    return chunks, next_block


def floor_note(step_s: float, floor_s: float, load: float) -> str:
    """What to print beside a measured step: nothing, or why it came out *below* the
    floor. A true floor cannot be beaten: a step under it means beta was
    under-measured (a busy machine slows the bandwidth probe more than a step), so
    the floor printed is too high, not the step too fast."""
    if step_s >= floor_s:
        return ""
    return (
        f"  below the floor: beta was under-measured (load {load:.1f}); "
        "the floor is too high, the step is not faster than memory"
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=None, help="cut the model's depth")
    parser.add_argument("--batches", default="1,2,4,8,16", help="batch sizes to time")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per batch size")
    parser.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")


def run(args: argparse.Namespace) -> int:
    from triollm.model.kvstore import DEFAULT_KV_DTYPE, kv_bytes_per_position
    from triollm.model.llama import LlamaModel, PagedKVCache
    from triollm.model.synthetic import (
        decode_weight_bytes,
        measure_bandwidth,
        random_weights,
        smollm2_config,
    )

    batches = [int(b) for b in args.batches.split(",")]
    config = smollm2_config(args.layers)
    model = LlamaModel(config, random_weights(config, args.dtype))
    w = decode_weight_bytes(model)
    load = os.getloadavg()[0]
    beta, _ = measure_bandwidth(gib=0.5, reps=5)
    per_pos = kv_bytes_per_position(config, DEFAULT_KV_DTYPE)  # PagedKVCache's default type
    print(
        f"SmolLM2-135M's shape, {config.num_hidden_layers} layers, {args.dtype}: "
        f"W = {w / 1e6:.0f} MB a step; A = {per_pos * CONTEXT / 1e6:.1f} MB a sequence "
        f"(K/V of ~{CONTEXT} positions); "
        f"β = {beta / 1e9:.1f} GB/s measured (load average {load:.1f}: on a busy machine "
        "β reads low and every floor high)"
    )
    print(f"  {'B':>3}  {'ms/step':>8}  {'floor':>7}  {'tok/s':>7}  {'floor tok/s':>11}  x B=1")
    base = None
    for b in batches:
        chunks, n_blocks = decode_plan(b)
        kv = PagedKVCache(config, n_blocks, BLOCK_SIZE)
        for _ in range(2):  # warm-up
            model.forward(chunks, kv)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            model.forward(chunks, kv)
            times.append(time.perf_counter() - t)
        step = statistics.median(times)
        a = sum(c.start + 1 for c in chunks) * per_pos
        floor = (w + a) / beta
        base = base or b / step
        print(
            f"  {b:>3}  {step * 1e3:>8.1f}  {floor * 1e3:>7.1f}  {b / step:>7.0f}  "
            f"{b / floor:>11.0f}  {b / step / base:>4.1f}x{floor_note(step, floor, load)}"
        )
    return 0
