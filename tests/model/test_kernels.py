"""Each numba kernel equals a plain-numpy reference on random shapes and data."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.model import kernels

SETTINGS = settings(max_examples=40, deadline=None)


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@SETTINGS
@given(n=st.integers(1, 9), d=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_rms_norm_equals_numpy(n: int, d: int, seed: int) -> None:
    rng = rng_for(seed)
    x, w = f32(rng, n, d), f32(rng, d)
    eps = np.float32(1e-5)
    out = np.empty_like(x)
    kernels.rms_norm(x, w, eps, out)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert out.dtype == np.float32


@SETTINGS
@given(
    n=st.integers(1, 6),
    heads=st.integers(1, 4),
    half=st.integers(1, 16),
    seed=st.integers(0, 2**32 - 1),
)
def test_rope_rotates_halves_like_numpy(n: int, heads: int, half: int, seed: int) -> None:
    rng = rng_for(seed)
    x = f32(rng, n, heads, 2 * half)
    max_pos = 50
    angles = rng.uniform(0, 6.3, (max_pos, half)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    positions = rng.integers(0, max_pos, n).astype(np.int64)
    got = x.copy()
    kernels.rope(got, positions, cos, sin)
    c = cos[positions][:, None, :]  # (n, 1, half)
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(n=st.integers(1, 5), f=st.integers(1, 80), seed=st.integers(0, 2**32 - 1))
def test_silu_mul_equals_numpy(n: int, f: int, seed: int) -> None:
    rng = rng_for(seed)
    gate_up = np.concatenate([f32(rng, n, f) * 4, f32(rng, n, f)], axis=1)
    gate, up = gate_up[:, :f], gate_up[:, f:]
    out = np.empty((n, f), np.float32)
    kernels.silu_mul(gate_up, out)
    g = gate.astype(np.float64)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * up, rtol=1e-5, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(f=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_silu_mul_gives_a_row_the_same_bits_alone_and_in_a_batch(f: int, seed: int) -> None:
    """Rows of one fused gate/up array, as the forward passes them.

    Two column ranges of that array (the old call) broke this: one row is
    C-contiguous, more rows are strided, and numba's two compiled versions
    rounded ``exp`` differently.
    """
    rows = 17
    rng = rng_for(seed)
    fused = f32(rng, rows, 2 * f) * 4
    batch = np.empty((rows, f), np.float32)
    kernels.silu_mul(fused, batch)
    for i in (0, rows // 2, rows - 1):
        alone = np.empty((1, f), np.float32)
        kernels.silu_mul(fused[i : i + 1], alone)
        np.testing.assert_array_equal(alone[0], batch[i])


@SETTINGS
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 8, 16]),
    block_size=st.sampled_from([1, 3, 4, 8]),
    window=st.sampled_from([0, 1, 5, 16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_attention_equals_dense_numpy(
    lens: list[int],
    n_kv: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int,
    seed: int,
) -> None:
    """Sequences of random lengths in shuffled blocks; each queried at random positions.

    The reference lays each sequence out densely, so a wrong block/offset lookup,
    a wrong GQA head, a leak across sequences or a wrong window bound all differ.
    """
    rng = rng_for(seed)
    n_heads = n_kv * group
    blocks_per_seq = [-(-length // block_size) for length in lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = rng.permutation(num_blocks)  # tables point at scattered blocks
    k_cache = f32(rng, num_blocks, n_kv, block_size, head_dim)
    v_cache = f32(rng, num_blocks, n_kv, block_size, head_dim)
    tables = np.zeros((len(lens), max(blocks_per_seq)), dtype=np.int64)
    taken = 0
    dense_k, dense_v = [], []
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = order[taken : taken + nb]
        taken += nb
        # (len, n_kv, head_dim): position p -> block tables[s, p // bs], offset p % bs
        p = np.arange(lens[s])
        dense_k.append(k_cache[tables[s, p // block_size], :, p % block_size])
        dense_v.append(v_cache[tables[s, p // block_size], :, p % block_size])
    rows = [(s, int(pos)) for s in range(len(lens)) for pos in rng.integers(0, lens[s], 2)]
    q = f32(rng, len(rows), n_heads, head_dim)
    positions = np.array([pos for _, pos in rows], dtype=np.int64)
    row_chunk = np.array([s for s, _ in rows], dtype=np.int64)
    scale = np.float32(1.0 / np.sqrt(head_dim))
    out = np.empty_like(q)
    kernels.paged_attention(q, k_cache, v_cache, positions, row_chunk, tables, window, scale, out)
    for i, (s, pos) in enumerate(rows):
        lo = max(0, pos - window + 1) if window else 0
        for h in range(n_heads):
            k = dense_k[s][lo : pos + 1, h // group].astype(np.float64)  # (ctx, head_dim)
            v = dense_v[s][lo : pos + 1, h // group].astype(np.float64)
            scores = k @ q[i, h] * scale
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ v
            np.testing.assert_allclose(out[i, h], want, rtol=1e-4, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(
    window=st.sampled_from([0, 50]),
    head_dim=st.sampled_from([16, 64, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_attention_gives_a_row_the_same_bits_alone_and_in_a_batch(
    window: int, head_dim: int, seed: int
) -> None:
    """16 rows of one sequence at once, and each alone: identical bits (batch invariance)."""
    rng = rng_for(seed)
    n_kv, group, block_size, length = 3, 3, 4, 300
    n_blocks = length // block_size
    k_cache = f32(rng, n_blocks, n_kv, block_size, head_dim)
    v_cache = f32(rng, n_blocks, n_kv, block_size, head_dim)
    tables = rng.permutation(n_blocks).astype(np.int64).reshape(1, n_blocks)
    positions = np.sort(rng.integers(200, length, 16)).astype(np.int64)
    row_chunk = np.zeros(16, np.int64)
    q = f32(rng, 16, n_kv * group, head_dim)
    scale = np.float32(0.25)
    batch = np.empty_like(q)
    kernels.paged_attention(q, k_cache, v_cache, positions, row_chunk, tables, window, scale, batch)
    for i in range(16):
        alone = np.empty_like(q[i : i + 1])
        kernels.paged_attention(
            q[i : i + 1],
            k_cache,
            v_cache,
            positions[i : i + 1],
            row_chunk[i : i + 1],
            tables,
            window,
            scale,
            alone,
        )
        np.testing.assert_array_equal(alone[0], batch[i])


@SETTINGS
@given(n=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_write_kv_stores_each_row_at_its_block_and_offset(n: int, seed: int) -> None:
    rng = rng_for(seed)
    num_blocks, n_kv, bs, hd = 6, 2, 4, 3
    k, v = f32(rng, n, n_kv, hd), f32(rng, n, n_kv, hd)
    slots = rng.choice(num_blocks * bs, n, replace=False)  # distinct (block, offset)
    block, offset = (slots // bs).astype(np.int64), (slots % bs).astype(np.int64)
    k_cache = np.zeros((num_blocks, n_kv, bs, hd), np.float32)
    v_cache = np.zeros_like(k_cache)
    kernels.write_kv(k, v, k_cache, v_cache, block, offset)
    np.testing.assert_array_equal(k_cache[block, :, offset], k)
    np.testing.assert_array_equal(v_cache[block, :, offset], v)
    untouched = np.ones((num_blocks, bs), bool)
    untouched[block, offset] = False
    assert not k_cache.transpose(0, 2, 1, 3)[untouched].any()


def test_kernels_release_the_gil_and_are_cached() -> None:
    """nogil keeps the server's event loop running during a step; cache avoids recompiling."""
    for kernel in (
        kernels.rms_norm,
        kernels.rope,
        kernels.silu_mul,
        kernels.write_kv,
        kernels.paged_attention,
    ):
        assert kernel.targetoptions["nogil"] is True, kernel
        assert kernel._cache.__class__.__name__ == "FunctionCache", kernel
