"""Gemma 3 (text): the pieces that differ from the Llama decoder, beside it.

A Gemma 3 layer is Llama's with a "sandwich" of norms and another activation::

    Llama:   x += attn(norm(x));             x += mlp(norm(x))
    Gemma 3: x += norm(attn(norm(x)));       x += norm(geglu(norm(x)))
                  ^ post_attention_layernorm        ^ post_feedforward_layernorm

and, around it:

- the embedding row is multiplied by ``sqrt(hidden_size)`` (in float32);
- every RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from 1):
  :func:`norm_weight` adds the 1 once, at load, so the forward's RMSNorm kernel
  is Llama's; llama.cpp's converter already wrote ``1 + weight`` into GGUF files;
- q and k get a per-head RMSNorm before RoPE (as Qwen3);
- the MLP is GeGLU with the tanh approximation of GELU (:func:`gelu_tanh_mul`);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not
  ``head_dim ** -0.5``;
- layers alternate: most are *sliding* (attend to the last ``sliding_window``
  positions, RoPE base ``rope_local_base_freq``, 10 000), every sixth is *full*
  (all positions, RoPE base ``rope_theta``, 1 000 000, with the config's
  scaling): :func:`layer_kinds`;
- ``final_logit_softcapping``, when set, squashes the logits with
  ``cap * tanh(logits / cap)`` (:func:`soft_cap`). ``attn_logit_softcapping``
  (Gemma 2's) would need the attention kernel to cap each score; Gemma 3
  configs leave it null, and a config that sets it is refused by name.

The sliding window and the paged KV cache: a sliding layer masks the positions
that left its window (the attention kernel's ``window``: row ``p`` reads
``p - W + 1 .. p``); the blocks stay allocated, because the full layers of the
same sequence still read every position and the block table is shared by all
layers. Freeing a window layer's old blocks would need per-layer block tables
(llama.cpp's separate SWA cache); this engine keeps one table, so it keeps the
blocks and only masks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, prange

from triollm.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """What a Gemma 3 checkpoint adds to :class:`~triollm.model.config.ModelConfig`."""

    sliding_window: int
    layer_sliding: tuple[bool, ...]  # per layer: True = sliding, False = full attention
    local_rope_theta: float  # RoPE base of the sliding layers (unscaled)
    query_pre_attn_scalar: float  # attention scores scaled by its -1/2 power
    final_logit_softcapping: float | None


def read_gemma(r: Any, d: Mapping[str, Any], n_layers: int) -> tuple[GemmaConfig, float, Any]:
    """The Gemma 3 fields of a config, and the *full* layers' RoPE (theta, scaling dict).

    ``r`` is config.py's field reader. Two spellings: transformers 5 writes
    ``rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}``;
    hub checkpoints carry ``rope_theta``, ``rope_local_base_freq`` and
    ``rope_scaling`` at the top level. Layer kinds come from ``layer_types``, or
    from ``sliding_window_pattern`` (every n-th layer full; 6 when absent).
    """
    src = r.source
    if r.string("hidden_activation", default="gelu_pytorch_tanh") not in (
        "gelu_pytorch_tanh",
        "gelu_tanh",
    ):
        raise ModelLoadError(f"{src}: hidden_activation must be 'gelu_pytorch_tanh' (GeGLU)")
    if d.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            f"{src}: attn_logit_softcapping is not supported (the attention kernel does not "
            "cap scores; Gemma 3 checkpoints leave it null)"
        )
    if r.boolean("use_bidirectional_attention", default=False):
        raise ModelLoadError(f"{src}: use_bidirectional_attention=true is not supported")
    types = d.get("layer_types")
    if types is None:
        pattern = r.positive_int("sliding_window_pattern", default=6)
        sliding = tuple(bool((i + 1) % pattern) for i in range(n_layers))
    else:
        kinds = ("sliding_attention", "full_attention")
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or any(t not in kinds for t in types)
        ):
            raise ModelLoadError(
                f"{src}: field 'layer_types' must list {n_layers} of {', '.join(kinds)}"
            )
        sliding = tuple(t == "sliding_attention" for t in types)
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        if not isinstance(full, Mapping) or not isinstance(local, Mapping):
            raise ModelLoadError(f"{src}: rope_parameters.*_attention must be objects")
        theta = full.get("rope_theta", 1_000_000.0)
        local_theta = local.get("rope_theta", 10_000.0)
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{src}: scaled RoPE on the sliding layers is not supported")
        scaling: Any = dict(full) if full.get("rope_type", "default") != "default" else None
    else:
        theta = d.get("rope_theta", 1_000_000.0)
        local_theta = d.get("rope_local_base_freq", 10_000.0)
        scaling = d.get("rope_scaling")
    for name, v in (("rope_theta", theta), ("rope_local_base_freq", local_theta)):
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ModelLoadError(f"{src}: field {name!r} must be a positive number, got {v!r}")
    cap = d.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0):
        raise ModelLoadError(
            f"{src}: field 'final_logit_softcapping' must be a positive number or null"
        )
    config = GemmaConfig(
        sliding_window=r.positive_int("sliding_window"),
        layer_sliding=sliding,
        local_rope_theta=float(local_theta),
        query_pre_attn_scalar=float(r.positive_float("query_pre_attn_scalar", default=256.0)),
        final_logit_softcapping=float(cap) if cap is not None else None,
    )
    return config, float(theta), scaling


def norm_weight(w: np.ndarray) -> np.ndarray:
    """A Gemma RMSNorm weight as the multiplier the kernel applies: ``1 + w`` (float32).

    transformers computes ``norm(x) * (1.0 + w.float())``; adding the 1 here, once,
    in float32, gives the same multiplier. Trap: llama.cpp's converter writes
    ``1 + w`` into GGUF files; ``gguf.py`` subtracts the 1 again (as transformers'
    GGUF loader does) so that every source hands the model the checkpoint's ``w``.
    """
    return (np.ascontiguousarray(w, np.float32) + np.float32(1.0)).astype(np.float32)


_GELU_C = np.float32(np.sqrt(2.0 / np.pi))


@njit(cache=True, nogil=True, parallel=True)
def gelu_tanh_mul(gate_up: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - numba
    """GeGLU's middle: ``out = gelu_tanh(gate) * up``, the fused [gate | up] layout of
    ``kernels.silu_mul`` (same hazard: take the whole array, never a column range).

    ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``, in float32, as
    torch's ``gelu(approximate="tanh")``. No fastmath: each element alone, so a row's
    bits do not depend on the batch.
    """
    n, f = out.shape
    c = _GELU_C
    for i in prange(n):
        for j in range(f):
            g = gate_up[i, j]
            inner = c * (g + np.float32(0.044715) * g * g * g)
            out[i, j] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(inner)) * gate_up[i, f + j]


def soft_cap(logits: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(logits / cap)`` in place (float32): logits squashed into (-cap, cap)."""
    c = np.float32(cap)
    np.divide(logits, c, out=logits)
    np.tanh(logits, out=logits)
    np.multiply(logits, c, out=logits)
    return logits
