"""Weight products: every ``x @ W.T`` of the forward pass goes through here.

A checkpoint stores a linear layer as ``W`` of shape ``[out, in]``. ``prepare``
turns it once, at load time, into a :class:`PreparedWeight` laid out for fast
products; ``linear`` then computes ``x @ W.T`` in float32 for a batch of rows.

This first version is the plain-numpy reference: the weight is widened to
float32 and stored transposed and contiguous (``[in, out]``), because BLAS runs
1.2-1.8x faster on that layout than on the transposed view at 4+ rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32 exactly.

    bfloat16 is the top half of a float32, so widening is a 16-bit shift.
    Trap: pass the *bits* (dtype uint16), not an already-converted array.
    """
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 weights must be raw uint16 bits, got dtype {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight ready for :func:`linear`.

    ``data`` is float32 ``[in, out]`` contiguous. ``nbytes`` is what one
    product reads from memory (the quantity the bandwidth floor counts).
    """

    data: np.ndarray  # (in_features, out_features) float32, C-contiguous
    in_features: int
    out_features: int

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype of the weight as held in memory."""
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes read from memory by one product, whatever the row count."""
        return int(self.data.nbytes)


def prepare(w: np.ndarray, *, bf16: bool = False) -> PreparedWeight:
    """Lay out a checkpoint weight ``w`` (``[out, in]``) for :func:`linear`.

    ``w`` is float32 or float16, or with ``bf16=True`` the raw uint16 bits of
    a bfloat16 tensor. Trap: a bf16 tensor must come as bits with
    ``bf16=True``; a uint16 array without the flag is rejected, never read as
    integers.
    """
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {w.shape}")
    if bf16:
        w32 = bf16_bits_to_f32(w)
    elif w.dtype in (np.float32, np.float16):
        w32 = w.astype(np.float32, copy=False)
    else:
        raise TypeError(
            f"weight dtype must be float32 or float16 (or uint16 bits with bf16=True), "
            f"got {w.dtype}"
        )
    out_features, in_features = w32.shape
    return PreparedWeight(
        data=np.ascontiguousarray(w32.T), in_features=in_features, out_features=out_features
    )


def linear(x: np.ndarray, w: PreparedWeight, out: np.ndarray | None = None) -> np.ndarray:
    """Return ``x @ W.T`` as float32 ``(n, out_features)`` for ``x`` float32 ``(n, in)``.

    With ``out`` given (float32, C-contiguous, shape ``(n, out_features)``) the
    result is written there and ``out`` is returned. Trap: ``x`` must be
    float32; a float64 ``x`` is rejected rather than silently promoting the
    residual stream.
    """
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be (n, {w.in_features}), got shape {x.shape}")
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if out is None:
        return x @ w.data
    np.matmul(x, w.data, out=out)
    return out
