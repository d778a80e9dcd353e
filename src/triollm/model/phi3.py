"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the pieces that differ from the Llama decoder.

A Phi-3 layer computes what a Llama layer computes (RMSNorm, RoPE attention with
GQA, SwiGLU, two residuals). What differs is how it is stored and how RoPE turns:

- **Fused projections.** The checkpoint holds q, k and v as one ``qkv_proj``
  (rows ``[q; k; v]``) and gate and up as one ``gate_up_proj`` (``[gate; up]``):
  the very layout this engine fuses every other family into (``LlamaLayer``), so
  the tensors are taken as they are (:func:`qkv_keys`, :func:`gate_up_keys`).
  llama.cpp's ``phi3`` files keep them fused too (``attn_qkv``, and ``ffn_up``
  holding gate and up).
- **Partial rotary** (``partial_rotary_factor``; Phi-4-mini 0.75): RoPE turns
  only the first ``rotary_dim`` dimensions of each head, pairing ``j`` with
  ``j + rotary_dim / 2``; the rest pass through unturned. The RoPE tables are
  ``rotary_dim / 2`` wide and the kernel turns as many pairs as they hold.
- **LongRoPE** (``rope_scaling.type`` ``longrope``, ``su`` in the first 128k
  configs): frequency ``i`` is divided by its own factor, from one of two lists,
  ``short_factor`` (for sequences within ``original_max_position_embeddings``)
  or ``long_factor`` (beyond), and cos and sin are multiplied by an attention
  factor, ``sqrt(1 + ln(s) / ln(original))`` with ``s = max_position_embeddings /
  original`` (1.19 for 128k over 4k). Both lists ride in the config (HF) or in
  ``rope_factors_short`` / ``rope_factors_long`` tensors (GGUF).
- a **sliding window** (Phi-3-mini-4k: 2047) where the config sets one, as
  Mistral's; transformers applies it. (llama.cpp disables Phi-3's window and
  warns; we follow transformers, the reference.)

**Which factor list.** transformers picks per forward call, by the longest
position in it: a sequence that grows past the original length switches from
short to long mid-generation while its cached K keep the short rotation, and
with chunked prefill or a prefix-cache hit the switch would fall at another
position, so a row's bits would depend on how its prompt was cut. This engine
picks once per model, by the context it serves (llama.cpp decides by its
``n_ctx``, vLLM by ``max_model_len``, for the same reason): the long list when
the context exceeds the original length, the short one otherwise
(:func:`uses_long_factors`, ``LlamaModel.use_context``). Every position of every
sequence then turns the same way whatever the batch, the chunking or the cache
did. Our logits equal transformers' for every sequence that stays on the same
side of the original length as the context (the fixtures prove both sides); a
sequence on the other side gets the list its server chose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from triollm.errors import ModelLoadError
from triollm.model.config import ModelConfig, RopeScaling

# transformers' Phi3Config default, used when a config names no training length
PHI3_ORIGINAL_CONTEXT = 4096


def qkv_keys(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The checkpoint keys of layer ``layer``'s q, k and v, stacked in this order.

    Phi-3 stores them as one tensor; every other family as three."""
    p = f"model.layers.{layer}.self_attn."
    if config.model_type == "phi3":
        return (p + "qkv_proj.weight",)
    return p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"


def gate_up_keys(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The checkpoint keys of a dense MLP's gate and up projections, stacked so."""
    p = f"model.layers.{layer}.mlp."
    if config.model_type == "phi3":
        return (p + "gate_up_proj.weight",)
    return p + "gate_proj.weight", p + "up_proj.weight"


def read_longrope(
    scaling: Mapping[str, Any],
    d: Mapping[str, Any],
    where: str,
    max_positions: int,
    rope_dim: int,
) -> RopeScaling:
    """A ``longrope`` scaling dict (``where`` names it in errors) as a RopeScaling.

    The training length is the config's top-level ``original_max_position_embeddings``
    (Phi-3 writes it there; transformers gives it priority over the copy inside
    ``rope_parameters``), else that copy, else transformers' default, 4096. ``factor``
    and ``attention_factor`` are optional, as in transformers: without them the
    factor is ``max_position_embeddings / original`` and the attention factor follows
    from it (the module docstring).
    """
    orig = d.get("original_max_position_embeddings")
    if orig is None:
        orig = scaling.get("original_max_position_embeddings", PHI3_ORIGINAL_CONTEXT)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 1:
        raise ModelLoadError(
            f"{where}: original_max_position_embeddings must be an integer > 1, got {orig!r}"
        )
    pairs = rope_dim // 2
    short = _factors(scaling, "short_factor", where, pairs)
    long = _factors(scaling, "long_factor", where, pairs)
    factor = _positive(scaling, "factor", where)
    if factor is None:
        factor = max_positions / orig
    attention = _positive(scaling, "attention_factor", where)
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=orig,
        short_factor=short,
        long_factor=long,
        attention_factor=attention,
    )


def _factors(scaling: Mapping[str, Any], key: str, where: str, pairs: int) -> tuple[float, ...]:
    v: Any = scaling.get(key)
    ok = isinstance(v, list | tuple) and len(v) == pairs
    if not ok or not all(
        isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f) and f > 0
        for f in v
    ):
        raise ModelLoadError(
            f"{where}: {key} must list {pairs} positive numbers (one per rotated pair "
            f"of dimensions), got {v!r}"
        )
    return tuple(float(f) for f in v)


def _positive(scaling: Mapping[str, Any], key: str, where: str) -> float | None:
    v = scaling.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ModelLoadError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def uses_long_factors(config: ModelConfig, context_tokens: int) -> bool:
    """Whether a model serving ``context_tokens`` positions turns with the long factors."""
    sc = config.rope_scaling
    assert sc is not None and sc.rope_type == "longrope"
    return context_tokens > sc.original_max_position_embeddings


def longrope_inverse_frequencies(config: ModelConfig, long: bool) -> np.ndarray:
    """LongRoPE's ``(rope_dim // 2,)`` float32 frequencies, the short or the long set.

    transformers' arithmetic, in float32 and in its order:
    ``1 / (factor_i * theta ** (2i / rope_dim))``.
    """
    sc = config.rope_scaling
    assert sc is not None and sc.rope_type == "longrope"
    d = config.rope_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    base = (np.float32(config.rope_theta) ** exponent).astype(np.float32)
    factors = np.asarray(sc.long_factor if long else sc.short_factor, np.float32)
    return (np.float32(1.0) / (factors * base)).astype(np.float32)
