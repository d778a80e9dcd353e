"""The paged KV cache's storage: its element type, its size, and how K/V go in.

K and V are computed in float32 and stored in one of four element types
(:class:`KVDtype`); attention (``attention.py``) widens each tile it loads back
to float32. The cache is the largest thing a long conversation holds: the
Qwen2.5-Coder-1.5B shape keeps 28 layers x 2 KV heads x 128 x 2 (K and V)
values per position, 57 KiB in float32, 28 KiB in 16 bits, 15 KiB in q8_0.

- ``f16`` (the default): IEEE half, llama.cpp's default cache type, the same
  28 KiB per position. 10 mantissa bits; |K|, |V| above 65504 saturate.
- ``bf16``: the top half of a float32; float32's range, 7 mantissa bits.
- ``f32``: exact; the conformance fixtures (token-exact against transformers)
  keep it.
- ``q8_0``: llama.cpp's ``--cache-type-k/-v q8_0``: blocks of 32 values along
  the head, an f16 scale ``d = max|x| / 127`` and 32 int8 ``round(x / d)``.

The measured accuracy of each against float32 is in docs/engine.md ("The KV
cache's element type"); ``tests/model/test_kv_dtype.py`` holds the 16-bit
caches to the float32 cache's greedy answers on the fixture models.
"""

from __future__ import annotations

import numpy as np

from triollm.model.config import ModelConfig
from triollm.sizing import DEFAULT_KV_DTYPE, KVDtype  # the type itself is pure (sizing.py)

Q8_BLOCK = 32  # values per q8_0 scale, along head_dim (llama.cpp's QK8_0)
# Columns of one V panel: V is stored as panels of this many head_dim columns,
# the width of the products' register tiles (matmul.PANEL; attention.py checks
# the two agree), so the V product reads a block of V where it lies.
V_PANEL = 32
_F16_MAX = np.float32(65504.0)


# numpy's dtype of the stored values (f16/bf16 as raw bits, like matmul.py)
STORAGE: dict[KVDtype, type] = {
    KVDtype.F16: np.int16,
    KVDtype.BF16: np.uint16,
    KVDtype.F32: np.float32,
    KVDtype.Q8_0: np.int8,
}


def kv_bytes_per_position(config: ModelConfig, dtype: KVDtype) -> int:
    """Bytes of K and V that one position occupies, over all layers, in ``dtype``.

    V counts its panels' padding: a head_dim that is not a multiple of
    :data:`V_PANEL` (none of the real models here; the tiny test models' 8 or
    16) stores V in whole panels of 32 columns.
    """
    item = np.dtype(STORAGE[dtype]).itemsize
    per_head = (config.head_dim + v_panels(config.head_dim) * V_PANEL) * item
    if dtype is KVDtype.Q8_0:
        per_head += 2 * 2 * _scale_count(config.head_dim)  # K's and V's f16 scales
    return config.num_hidden_layers * config.num_key_value_heads * per_head


def _scale_count(head_dim: int) -> int:
    return -(-head_dim // Q8_BLOCK)


def v_panels(head_dim: int) -> int:
    """V panels of :data:`V_PANEL` columns per head (the last one padded)."""
    return -(-head_dim // V_PANEL)


class PagedKVCache:
    """The K and V of every cached position, in blocks, for all layers.

    A sequence's position ``p`` lives in block ``block_table[p // block_size]``
    at offset ``p % block_size``. Its key is ``k[layer, block, kv_head, :,
    offset]``: K is stored *transposed within a block*, ``(head_dim,
    block_size)`` per block and head, because attention multiplies a tile of
    keys with the positions along the vector lanes, and this way each of a
    tile's ``head_dim`` rows is one contiguous run (position-major, the load was
    a transpose that cost a 1.5B decode step at depth 4096 more than its
    arithmetic). Its value is ``v[layer, block, kv_head, :, offset, :]``
    flattened: V is stored in *panels* of :data:`V_PANEL` columns,
    ``(head_dim / 32, block_size, 32)`` per block and head, the layout the
    weight products' register tiles read (``matmul.py``), so with blocks of 32
    positions the V product reads each block where it lies, as the score
    product reads K (position-major, each tile visit copied V into that layout
    first: 128 widened runs of 32 per visit of a Qwen2.5-1.5B head).
    The last panel's columns past head_dim are padding: stored, never
    returned. ``k_scale``/``v_scale`` hold q8_0's per-32 f16 scales, one per
    32 values along the head and position, both ``(head_dim / 32,
    block_size)`` per block and head, and are a 1-element placeholder for the
    other types. :meth:`position` gives one position's K and V whatever the
    layout.

    Allocated once, zeroed, at the size the scheduler's pool was given. The
    cache does not know which sequence owns a block: ownership is the block
    pool's (``kv.py``); the cache is only storage.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: KVDtype = DEFAULT_KV_DTYPE,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_position = kv_bytes_per_position(config, dtype)
        lead = (config.num_hidden_layers, num_blocks, config.num_key_value_heads)
        hd, ns, nvp = config.head_dim, _scale_count(config.head_dim), v_panels(config.head_dim)
        self.head_dim = hd
        # k: (n_layers, num_blocks, n_kv_heads, head_dim, block_size) storage dtype
        # v: (n_layers, num_blocks, n_kv_heads, head_dim / 32, block_size, 32) storage dtype
        self.k: np.ndarray = np.zeros((*lead, hd, block_size), dtype=STORAGE[dtype])
        self.v: np.ndarray = np.zeros((*lead, nvp, block_size, V_PANEL), dtype=STORAGE[dtype])
        scales = (*lead, ns, block_size)
        if dtype is not KVDtype.Q8_0:
            scales = (config.num_hidden_layers, 1, 1, 1, 1)
        # q8_0: (n_layers, num_blocks, n_kv_heads, head_dim / 32, block_size), f16 bits
        self.k_scale = np.zeros(scales, dtype=np.int16)
        self.v_scale = np.zeros(scales, dtype=np.int16)

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.dtype is KVDtype.Q8_0 else 0
        return int(self.k.nbytes + self.v.nbytes + scales)  # the placeholders do not count

    def position(self, layer: int, block: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of one stored position's K, ``(n_kv_heads, head_dim)``, and V,
        ``(n_kv_heads, head_dim / 32, 32)`` (its panels' rows, padding included).

        In the storage dtype; writing through them changes the cache (tests plant
        garbage this way). Both are strided: K is transposed within a block, and
        a position's V is one row of 32 in each panel. :meth:`values` gives V
        as ``(n_kv_heads, head_dim)``, a copy.
        """
        return self.k[layer, block, :, :, offset], self.v[layer, block, :, :, offset, :]

    def values(self, layer: int, block: int, offset: int) -> np.ndarray:
        """One stored position's V, ``(n_kv_heads, head_dim)``, a copy in the storage dtype."""
        v = self.v[layer, block, :, :, offset, :]
        return v.reshape(v.shape[0], -1)[:, : self.head_dim].copy()

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``(n, n_kv_heads, head_dim)`` float32 -> (values, scales or None) to store.

        Rounded to nearest even in every type. Hazard: f16 saturates at
        +-65504 instead of turning into inf (an inf key would make a NaN score).
        """
        d = self.dtype
        if d is KVDtype.F32:
            return x, None
        if d is KVDtype.F16:
            return np.clip(x, -_F16_MAX, _F16_MAX).astype(np.float16).view(np.int16), None
        if d is KVDtype.BF16:
            u = x.view(np.uint32)
            return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(
                np.uint16
            ), None
        return _q8_0(x)


def _q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 blocks along the last axis: int8 values and f16 scales (as int16 bits)."""
    n, h, hd = x.shape
    nb = _scale_count(hd)
    padded = np.zeros((n, h, nb * Q8_BLOCK), np.float32)
    padded[..., :hd] = x
    blocks = padded.reshape(n, h, nb, Q8_BLOCK)
    d16 = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float16)
    d = d16.astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q.reshape(n, h, -1)[..., :hd]), d16.view(np.int16)


__all__ = [
    "DEFAULT_KV_DTYPE",
    "STORAGE",
    "V_PANEL",
    "KVDtype",
    "PagedKVCache",
    "kv_bytes_per_position",
    "v_panels",
]
