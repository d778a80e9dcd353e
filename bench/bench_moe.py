"""A mixture of experts' decode step against a dense model of the same active size.

    python bench/bench_moe.py [--layers 12] [--rounds 3] [--steps 12] [--dtype bf16]

Two random models of one shape (SmolLM2-135M's attention and vocabulary, fewer
layers): a Mixtral-style MoE with 8 experts of width 768, top-2 per token, and a
dense twin whose MLP is 1536 wide, so a token multiplies the same number of MLP
parameters in both (2 x 768). Each is prefilled with 32 tokens per sequence, then
``--steps`` decode steps are timed, at batch 1 and batch 16; the models alternate
per round so a load change on a shared machine hits both.

What the difference means: at batch 1 the MoE reads the same MLP bytes as the
dense twin (two experts), plus the router, so the time difference is the cost of
routing and gathering (the router product, top-k, grouping rows by expert, one
product launch per chosen expert instead of one per layer). At batch 16 the rows
choose ~all experts between them (random routing: 1 - (6/8)^16 of the experts are
hit), so the MoE also reads ~4x the dense MLP's bytes: the bytes per step are
printed beside the times, to keep the two causes apart.

Timings on a busy machine are not verdicts: the load average is printed per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel, PagedKVCache
from triollm.model.synthetic import SMOLLM2_135M, random_weights
from triollm.plan import ChunkPlan

BLOCK = 32
PROMPT = 32


def configs(layers: int) -> tuple[ModelConfig, ModelConfig]:
    base = dict(SMOLLM2_135M, num_hidden_layers=layers)
    moe = ModelConfig.from_dict(
        base
        | {
            "model_type": "mixtral",
            "intermediate_size": 768,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
        source="bench MoE",
    )
    dense = ModelConfig.from_dict(base | {"intermediate_size": 1536}, source="bench dense")
    return moe, dense


def decode_ms(model: LlamaModel, batch: int, steps: int) -> float:
    """Median ms of one decode step of ``batch`` sequences, after a 32-token prefill each."""
    c = model.config
    per_seq = -(-(PROMPT + steps + 1) // BLOCK)
    kv = PagedKVCache(c, per_seq * batch, BLOCK)
    rng = np.random.default_rng(batch)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [tuple(int(t) for t in rng.integers(5, c.vocab_size, PROMPT)) for _ in range(batch)]
    chunks = [
        ChunkPlan(i, prompts[i], 0, tables[i], sample=True, prefill=True) for i in range(batch)
    ]
    logits = model.forward(chunks, kv)
    times = []
    for step in range(steps):
        chunks = [
            ChunkPlan(
                i,
                (int(np.argmax(logits[i])),),
                PROMPT + step,
                tables[i],
                sample=True,
                prefill=False,
            )
            for i in range(batch)
        ]
        t = time.perf_counter()
        logits = model.forward(chunks, kv)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def mlp_bytes_read(model: LlamaModel, batch: int) -> int:
    """MLP weight bytes a decode step of random tokens reads (experts hit, on average)."""
    total = 0
    for layer in model.layers:
        if layer.moe is not None:
            n = len(layer.moe.experts)
            k = layer.moe.top_k
            hit = n * (1 - ((n - k) / n) ** batch)  # expected experts chosen by >= 1 row
            e = layer.moe.experts[0]
            total += layer.moe.router.nbytes + int(
                hit * (e.gate_up_proj.nbytes + e.down_proj.nbytes)
            )
        elif layer.gate_up_proj is not None and layer.down_proj is not None:
            total += layer.gate_up_proj.nbytes + layer.down_proj.nbytes
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    args = p.parse_args()
    moe_c, dense_c = configs(args.layers)
    models = {
        "moe": LlamaModel(moe_c, random_weights(moe_c, args.dtype)),
        "dense": LlamaModel(dense_c, random_weights(dense_c, args.dtype)),
    }
    for name, m in models.items():
        decode_ms(m, 1, 2)  # compile / warm
        b1, b16 = mlp_bytes_read(m, 1) / 1e6, mlp_bytes_read(m, 16) / 1e6
        print(
            f"{name}: {m.weight_bytes / 1e6:.0f} MB of weights; MLP bytes per decode step "
            f"batch 1 {b1:.1f} MB, batch 16 {b16:.1f} MB"
        )
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for batch in (1, 16):
            for name in ("dense", "moe") if r % 2 else ("moe", "dense"):
                ms = decode_ms(models[name], batch, args.steps)
                results.setdefault((name, batch), []).append(ms)
        print(f"round {r + 1}: load {os.getloadavg()[0]:.1f}", flush=True)
    for batch in (1, 16):
        d, m = results[("dense", batch)], results[("moe", batch)]
        print(
            f"batch {batch:2d}: dense {' '.join(f'{x:6.1f}' for x in d)} ms | "
            f"moe {' '.join(f'{x:6.1f}' for x in m)} ms | "
            f"moe - dense (medians) {statistics.median(m) - statistics.median(d):+.1f} ms/step "
            f"({statistics.median(m) / statistics.median(d):.2f}x)"
        )


if __name__ == "__main__":
    main()
