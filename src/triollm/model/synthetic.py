"""A model of a real shape with random weights, and the machine's memory bandwidth.

Speed depends on a model's shapes and dtypes, not on its values, so the benchmarks
and ``triollm demo batching`` build SmolLM2-135M's shape with random weights at run
time (nothing is downloaded, nothing is committed) and measure the bandwidth that
bounds a decode step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, prange

from triollm.model.config import ModelConfig

# SmolLM2-135M's config.json, trimmed to the fields the engine reads.
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def smollm2_config(layers: int | None = None) -> ModelConfig:
    """SmolLM2-135M's shape; ``layers`` cuts the depth (a quicker, smaller model)."""
    raw = dict(SMOLLM2_135M)
    if layers is not None:
        raw["num_hidden_layers"] = layers
    return ModelConfig.from_dict(raw, source="SmolLM2-135M shape (built in)")


def random_weights(config: ModelConfig, dtype: str, seed: int = 0) -> Callable[[str], np.ndarray]:
    """A getter ``key -> array`` making each tensor on demand (float32, or bf16 bits).

    Norm weights are ones, matrices N(0, 0.02): the values do not change the
    speed, only the shapes and dtypes do. On demand, so the raw model is never
    in memory beside the prepared one.
    """
    from triollm.model.weights import expected_shapes

    shapes = expected_shapes(config)
    rng = np.random.default_rng(seed)

    def get(key: str) -> np.ndarray:
        shape = shapes[key]
        if len(shape) == 1:
            a = np.ones(shape, np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32)
            a *= np.float32(0.02)
        if dtype == "bf16":
            return (a.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # truncation is fine
        return a

    return get


def decode_weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads: every projection plus the output head."""
    total = int(model.lm_head.nbytes)
    for layer in model.layers:
        # q/k/v and gate/up are fused into one prepared weight each (llama.py)
        for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if w is not None:  # None: the dense MLP of a sparse (MoE) layer
                total += int(w.nbytes)
    return total


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _stream_sum(a: np.ndarray) -> float:  # pragma: no cover - numba
    # a (chunks, m) float32: each thread sums whole rows, so every byte is read once
    partial = np.zeros(a.shape[0], np.float32)
    for c in prange(a.shape[0]):
        row = a[c]
        acc = np.float32(0.0)
        for i in range(row.shape[0]):
            acc += row[i]
        partial[c] = acc
    return float(partial.sum())


def measure_bandwidth(gib: float = 1.0, reps: int = 7) -> tuple[float, float]:
    """Best and median sustained read bandwidth (bytes/s) over a ``gib`` GiB array."""
    n = int(gib * (1 << 30) // 4)
    a = np.ones((64, n // 64), np.float32)  # written once, so every page is resident
    _stream_sum(a[:, :1024])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        _stream_sum(a)
        times.append(time.perf_counter() - t)
    return a.nbytes / min(times), a.nbytes / statistics.median(times)
