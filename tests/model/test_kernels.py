"""Each numba kernel equals a plain-numpy reference on random shapes and data."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from triollm.model import attention, kernels
from triollm.model.config import ModelConfig
from triollm.model.kvstore import V_PANEL, KVDtype, PagedKVCache, v_panels

SETTINGS = settings(max_examples=40, deadline=None)


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def as_panels(v: np.ndarray) -> np.ndarray:
    """Position-major V ``(num_blocks, n_kv, bs, hd)`` -> the pool's panels
    ``(num_blocks, n_kv, hd / 32, bs, 32)``, the padding columns zero."""
    nb, n_kv, bs, hd = v.shape
    nvp = v_panels(hd)
    padded = np.zeros((nb, n_kv, bs, nvp * V_PANEL), v.dtype)
    padded[..., :hd] = v
    return np.ascontiguousarray(padded.reshape(nb, n_kv, bs, nvp, V_PANEL).transpose(0, 1, 3, 2, 4))


def position_major(v: np.ndarray, hd: int) -> np.ndarray:
    """The pool's V panels ``(num_blocks, n_kv, hd / 32, bs, 32)`` -> ``(num_blocks,
    n_kv, bs, hd)``: each position's values in order, the padding dropped."""
    nb, n_kv, nvp, bs, _ = v.shape
    return v.transpose(0, 1, 3, 2, 4).reshape(nb, n_kv, bs, nvp * V_PANEL)[..., :hd]


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
    lens=st.lists(st.integers(1, 100), min_size=1, max_size=4),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 4, 8, 16]),
    block_size=st.sampled_from([1, 3, 4, 8, 32]),  # 32: K read in place (f32, f16)
    window=st.sampled_from([0, 1, 5, 16]),
    segment=st.sampled_from([32, 64, 1024]),
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_attention_equals_dense_numpy(
    lens: list[int],
    n_kv: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int,
    segment: int,
    seed: int,
) -> None:
    """Sequences of random lengths in shuffled blocks; each queried at random positions.

    The reference lays each sequence out densely, so a wrong block/offset lookup,
    a wrong GQA head, a leak across sequences or a wrong window bound all differ.
    Short segments split these short contexts into several partial softmaxes,
    so the merge is checked too.
    """
    saved = attention.SEGMENT_POSITIONS
    attention.SEGMENT_POSITIONS = segment
    try:
        _attention_equals_dense(lens, n_kv, group, head_dim, block_size, window, seed)
    finally:
        attention.SEGMENT_POSITIONS = saved


def _attention_equals_dense(
    lens: list[int], n_kv: int, group: int, head_dim: int, block_size: int, window: int, seed: int
) -> None:
    rng = rng_for(seed)
    n_heads = n_kv * group
    blocks_per_seq = [-(-length // block_size) for length in lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = rng.permutation(num_blocks)  # tables point at scattered blocks
    k_cache = f32(rng, num_blocks, n_kv, head_dim, block_size)  # K transposed in a block
    v_dense = f32(rng, num_blocks, n_kv, block_size, head_dim)  # position-major
    v_cache = as_panels(v_dense)  # the pool's panels of 32 columns
    tables = np.zeros((len(lens), max(blocks_per_seq)), dtype=np.int64)
    taken = 0
    dense_k, dense_v = [], []
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = order[taken : taken + nb]
        taken += nb
        # (len, n_kv, head_dim): position p -> block tables[s, p // bs], offset p % bs
        p = np.arange(lens[s])
        dense_k.append(k_cache[tables[s, p // block_size], :, :, p % block_size])
        dense_v.append(v_dense[tables[s, p // block_size], :, p % block_size])
    rows = [(s, int(pos)) for s in range(len(lens)) for pos in rng.integers(0, lens[s], 2)]
    rows += [(s, lens[s] - 1) for s in range(len(lens))]  # each sequence's last position
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
    segment=st.sampled_from([64, 1024]),
    dtype=st.sampled_from(list(KVDtype)),
    block_size=st.sampled_from([4, 32]),  # 32: f32 and f16 read K's blocks in place
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_attention_gives_a_row_the_same_bits_alone_and_in_a_batch(
    window: int, head_dim: int, segment: int, dtype: KVDtype, block_size: int, seed: int
) -> None:
    """16 rows of one sequence at once, and each alone: identical bits (batch invariance).

    The rows share query blocks and segments in the batch and have them to
    themselves alone; the tiles, segments and merge order follow the row's own
    position only, in every storage type of the cache.
    """
    saved = attention.SEGMENT_POSITIONS
    attention.SEGMENT_POSITIONS = segment
    try:
        _row_alone_and_in_a_batch(window, head_dim, dtype, block_size, seed)
    finally:
        attention.SEGMENT_POSITIONS = saved


def _row_alone_and_in_a_batch(
    window: int, head_dim: int, dtype: KVDtype, block_size: int, seed: int
) -> None:
    rng = rng_for(seed)
    n_kv, group, length = 3, 3, 300
    n_blocks = -(-length // block_size)
    k_cache, v_cache, k_scale, v_scale = stored_cache(
        rng, dtype, n_blocks, n_kv, block_size, head_dim
    )
    tables = rng.permutation(n_blocks).astype(np.int64).reshape(1, n_blocks)
    positions = np.sort(rng.integers(200, length, 16)).astype(np.int64)
    row_chunk = np.zeros(16, np.int64)
    q = f32(rng, 16, n_kv * group, head_dim)
    scale = np.float32(0.25)
    batch = np.empty_like(q)
    # the batch on both cores, each row alone on this thread (odd rows) or as planned:
    # the two drivers call the one compiled item, so they must agree to the bit
    plan = attention.plan_attention(positions, row_chunk, window, n_kv, n_kv * group, head_dim)
    kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        positions,
        row_chunk,
        tables,
        window,
        scale,
        batch,
        k_scale,
        v_scale,
        dataclasses.replace(plan, parallel=True),
    )
    for i in range(16):
        alone = np.empty_like(q[i : i + 1])
        one = attention.plan_attention(
            positions[i : i + 1], row_chunk[i : i + 1], window, n_kv, n_kv * group, head_dim
        )
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
            k_scale,
            v_scale,
            dataclasses.replace(one, parallel=False) if i % 2 else one,
        )
        np.testing.assert_array_equal(alone[0], batch[i])


def stored_cache(
    rng: np.random.Generator, dtype: KVDtype, n_blocks: int, n_kv: int, bs: int, hd: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random K and V for one layer, stored the way ``PagedKVCache.encode`` stores them."""
    config = tiny_config(n_kv, hd)
    kv = PagedKVCache(config, n_blocks, bs, dtype)
    for cache, scales in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
        x = f32(rng, n_blocks * bs, n_kv, hd)
        values, s = kv.encode(x)
        by_block = values.reshape(n_blocks, bs, n_kv, hd)
        # K transposed within a block (head_dim, bs), V in panels (hd / 32, bs, 32)
        if cache is kv.k:
            cache[0] = by_block.transpose(0, 2, 3, 1)
        else:
            cache[0] = as_panels(by_block.transpose(0, 2, 1, 3))
        if s is not None:  # both transposed as K: (head_dim / 32, bs)
            scales[0] = s.reshape(n_blocks, bs, n_kv, -1).transpose(0, 2, 3, 1)
    return kv.k[0], kv.v[0], kv.k_scale[0], kv.v_scale[0]


def widened(cache: np.ndarray, scales: np.ndarray, dtype: KVDtype) -> np.ndarray:
    """The float32 values a stored cache means (numpy's own conversions).

    Position-major: ``(..., position, head_dim)``, scales along the last axis."""
    if dtype is KVDtype.F32:
        return cache
    if dtype is KVDtype.F16:
        return cache.view(np.float16).astype(np.float32)
    if dtype is KVDtype.BF16:
        return (cache.astype(np.uint32) << np.uint32(16)).view(np.float32)
    d = scales.view(np.float16).astype(np.float32)  # (..., head_dim // 32)
    return cache.astype(np.float32) * np.repeat(d, 32, axis=-1)[..., : cache.shape[-1]]


def tiny_config(n_kv: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": n_kv,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "vocab_size": 8,
            "max_position_embeddings": 64,
        },
        source="<test>",
    )


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from(list(KVDtype)),
    head_dim=st.sampled_from([32, 64, 128]),
    length=st.integers(1, 200),
    bs=st.sampled_from([8, 32]),  # 32: f32 and f16 read K's blocks in place
    seed=st.integers(0, 2**32 - 1),
)
def test_each_cache_type_attends_over_the_values_it_stores(
    dtype: KVDtype, head_dim: int, length: int, bs: int, seed: int
) -> None:
    """The kernel's widening (f16 bits, bf16 bits, q8_0 blocks) equals numpy's."""
    rng = rng_for(seed)
    n_kv, group = 2, 2
    n_blocks = -(-length // bs)
    k_cache, v_cache, k_scale, v_scale = stored_cache(rng, dtype, n_blocks, n_kv, bs, head_dim)
    # (n_blocks, n_kv, bs, head_dim) float32; K (and its scales) back to position-major
    k = widened(k_cache.transpose(0, 1, 3, 2), k_scale.transpose(0, 1, 3, 2), dtype)
    v = widened(position_major(v_cache, head_dim), v_scale.transpose(0, 1, 3, 2), dtype)
    tables = np.arange(n_blocks, dtype=np.int64).reshape(1, n_blocks)
    q = f32(rng, 1, n_kv * group, head_dim)
    out = np.empty_like(q)
    pos = np.array([length - 1], np.int64)
    scale = np.float32(1 / np.sqrt(head_dim))
    kernels.paged_attention(
        q, k_cache, v_cache, pos, np.zeros(1, np.int64), tables, 0, scale, out, k_scale, v_scale
    )
    dense_k = k.transpose(0, 2, 1, 3).reshape(-1, n_kv, head_dim)[:length].astype(np.float64)
    dense_v = v.transpose(0, 2, 1, 3).reshape(-1, n_kv, head_dim)[:length].astype(np.float64)
    for h in range(n_kv * group):
        scores = dense_k[:, h // group] @ q[0, h] * scale
        p = np.exp(scores - scores.max())
        np.testing.assert_allclose(
            out[0, h], (p / p.sum()) @ dense_v[:, h // group], rtol=1e-4, atol=1e-5
        )


@SETTINGS
@given(n=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_write_kv_stores_each_row_at_its_block_and_offset(n: int, seed: int) -> None:
    rng = rng_for(seed)
    num_blocks, n_kv, bs, hd = 6, 2, 4, 3
    k, v = f32(rng, n, n_kv, hd), f32(rng, n, n_kv, hd)
    slots = rng.choice(num_blocks * bs, n, replace=False)  # distinct (block, offset)
    block, offset = (slots // bs).astype(np.int64), (slots % bs).astype(np.int64)
    k_cache = np.zeros((num_blocks, n_kv, hd, bs), np.float32)  # K transposed in a block
    v_cache = np.zeros((num_blocks, n_kv, 1, bs, V_PANEL), np.float32)  # V's one panel
    kernels.write_kv(k, v, k_cache, v_cache, block, offset)
    np.testing.assert_array_equal(k_cache[block, :, :, offset], k)
    np.testing.assert_array_equal(position_major(v_cache, hd)[block, :, offset], v)
    untouched = np.ones((num_blocks, bs), bool)
    untouched[block, offset] = False
    assert not k_cache.transpose(0, 3, 1, 2)[untouched].any()
    assert not v_cache.transpose(0, 3, 1, 2, 4)[untouched].any()
    assert not v_cache[..., hd:].any()  # the panel's padding columns are never written


def test_kernels_release_the_gil_and_are_cached() -> None:
    """nogil keeps the server's event loop running during a step; cache avoids recompiling."""
    for kernel in (
        kernels.rms_norm,
        kernels._rms_norm_row,
        kernels.rope,
        kernels._silu_row,
        kernels._silu_rows,
        kernels._silu_rows_serial,
        kernels.write_kv,
        kernels.store_kv,
        kernels.rope_qk,
        kernels.qkv_rope_store,
        attention._plan,
        attention._item,
        attention._attend,
        attention._attend_serial,
        attention._merge,
    ):
        assert kernel.targetoptions["nogil"] is True, kernel
        assert kernel._cache.__class__.__name__ == "FunctionCache", kernel


# edges of the 16-bit roundings: saturation, the largest halves, ties, subnormals, zeros
EDGES = np.array(
    [65504, 65505, 65519, 65520, 1e10, -1e10, np.inf, -np.inf, 1 + 2**-11, 1 + 3 * 2**-11,
     6e-8, 3e-8, 1e-6, -1e-6, 0.0, -0.0, 1.00390625, 1.01171875, 3.4e38, 1e-40],
    np.float32,
)  # fmt: skip


@SETTINGS
@given(
    n=st.integers(1, 6),
    dtype=st.sampled_from([KVDtype.F32, KVDtype.F16, KVDtype.BF16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_store_kv_rounds_and_places_as_encode_then_write_kv(
    n: int, dtype: KVDtype, seed: int
) -> None:
    """The forward's one-call KV store equals PagedKVCache.encode + write_kv, to the bit."""
    rng = rng_for(seed)
    n_blocks, n_kv, bs, hd = 4, 2, 4, 16
    config = tiny_config(n_kv, hd)
    x = f32(rng, 2, n, n_kv, hd) * rng.choice([1e-6, 1.0, 3e4], (2, n, n_kv, 1)).astype(np.float32)
    x.reshape(-1)[: len(EDGES)] = EDGES[: x.size]  # the edges first, random values after
    k, v = x[0], x[1]
    slots = rng.choice(n_blocks * bs, n, replace=False)
    block, offset = (slots // bs).astype(np.int64), (slots % bs).astype(np.int64)
    want = PagedKVCache(config, n_blocks, bs, dtype)
    got = PagedKVCache(config, n_blocks, bs, dtype)
    kernels.write_kv(want.encode(k)[0], want.encode(v)[0], want.k[0], want.v[0], block, offset)
    kernels.store_kv(k, v, got.k[0], got.v[0], block, offset)
    assert got.k.tobytes() == want.k.tobytes()
    assert got.v.tobytes() == want.v.tobytes()


def test_store_kv_keeps_a_nan_a_nan() -> None:
    """A NaN key is a bug upstream; storing it as +-65504 would hide it."""
    config = tiny_config(1, 4)
    for dtype in (KVDtype.F16, KVDtype.BF16):
        kv = PagedKVCache(config, 1, 1, dtype)
        x = np.full((1, 1, 4), np.nan, np.float32)
        zero = np.zeros(1, np.int64)
        kernels.store_kv(x, x, kv.k[0], kv.v[0], zero, zero)
        widened_k = widened(kv.k[0].transpose(0, 1, 3, 2), kv.k_scale[0], dtype)
        assert np.isnan(widened_k).all()


@SETTINGS
@given(n=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_rope_qk_rotates_queries_and_keys_as_rope_does(n: int, seed: int) -> None:
    rng = rng_for(seed)
    q, k = f32(rng, n, 6, 16), f32(rng, n, 2, 16)
    angles = rng.uniform(0, 6.3, (40, 8)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    positions = rng.integers(0, 40, n).astype(np.int64)
    want_q, want_k = q.copy(), k.copy()
    kernels.rope(want_q, positions, cos, sin)
    kernels.rope(want_k, positions, cos, sin)
    kernels.rope_qk(q, k, positions, cos, sin)
    assert q.tobytes() == want_q.tobytes() and k.tobytes() == want_k.tobytes()


@SETTINGS
@given(
    n=st.integers(1, 5),
    dtype=st.sampled_from([KVDtype.F32, KVDtype.F16, KVDtype.BF16]),
    biased=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_qkv_rope_store_is_the_split_bias_rope_and_store_by_stages(
    n: int, dtype: KVDtype, biased: bool, seed: int
) -> None:
    """The forward's one call per layer gives the bits of the stages it replaces."""
    rng = rng_for(seed)
    n_heads, n_kv, hd, n_blocks, bs = 6, 2, 16, 4, 4
    q_dim, kv_dim = n_heads * hd, n_kv * hd
    qkv = f32(rng, n, q_dim + 2 * kv_dim)
    bias = f32(rng, q_dim + 2 * kv_dim) if biased else np.zeros(0, np.float32)
    angles = rng.uniform(0, 6.3, (40, hd // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    positions = rng.integers(0, 40, n).astype(np.int64)
    slots = rng.choice(n_blocks * bs, n, replace=False)
    block, offset = (slots // bs).astype(np.int64), (slots % bs).astype(np.int64)
    config = tiny_config(n_kv, hd)
    # by stages, as the forward does for qwen3 and q8_0
    staged = qkv + bias if biased else qkv.copy()
    want_q = np.ascontiguousarray(staged[:, :q_dim]).reshape(n, n_heads, hd)
    want_k = np.ascontiguousarray(staged[:, q_dim : q_dim + kv_dim]).reshape(n, n_kv, hd)
    want_v = np.ascontiguousarray(staged[:, q_dim + kv_dim :]).reshape(n, n_kv, hd)
    kernels.rope_qk(want_q, want_k, positions, cos, sin)
    want = PagedKVCache(config, n_blocks, bs, dtype)
    kernels.store_kv(want_k, want_v, want.k[0], want.v[0], block, offset)
    # in one call
    q = np.empty((n, n_heads, hd), np.float32)
    k, v = np.empty((n, n_kv, hd), np.float32), np.empty((n, n_kv, hd), np.float32)
    got = PagedKVCache(config, n_blocks, bs, dtype)
    kernels.qkv_rope_store(
        qkv, bias, positions, cos, sin, q, k, v, got.k[0], got.v[0], block, offset
    )
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    assert got.k.tobytes() == want.k.tobytes() and got.v.tobytes() == want.v.tobytes()


def _decode_row(position: int, n_kv: int, group: int, head_dim: int) -> attention.AttentionPlan:
    one = np.array([position], np.int64)
    return attention.plan_attention(one, np.zeros(1, np.int64), 0, n_kv, n_kv * group, head_dim)


def test_a_plan_opens_a_parallel_region_by_its_work_not_its_tile_count() -> None:
    # SmolLM2 (3 KV heads x 3 query heads x 64) at position 128: 15 tile visits
    # of cheap work (2880 units), a few us, less than waking the other worker
    small = _decode_row(128, 3, 3, 64)
    assert small.work == 3 * 5 * 3 * 64
    assert not small.parallel
    # Qwen2.5-1.5B (2 KV heads x 6 x 128) at 4096: ~0.8 ms of one thread's work
    deep = _decode_row(4096, 2, 6, 128)
    assert deep.work == 2 * 129 * 6 * 128
    assert deep.parallel
    # the line itself: the first depth whose work reaches PARALLEL_MIN_WORK
    per_tile = 3 * 3 * 64
    tiles = -(-attention.PARALLEL_MIN_WORK // per_tile)
    assert not _decode_row((tiles - 1) * 32 - 1, 3, 3, 64).parallel
    assert _decode_row(tiles * 32 - 1, 3, 3, 64).parallel


@settings(max_examples=10, deadline=None)
@given(
    lanes=st.integers(1, 5),
    depth=st.integers(0, 700),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_parallel_driver_runs_each_item_once_however_many_lanes_claim(
    lanes: int, depth: int, seed: int
) -> None:
    # _attend hands its items out by an atomic counter: every item must be run
    # by exactly one lane, into its own partials, whatever the lanes and threads
    saved = attention.SEGMENT_POSITIONS
    attention.SEGMENT_POSITIONS = 64  # many segments: many items to claim
    try:
        rng = rng_for(seed)
        n_kv, group, hd, bs = 2, 3, 32, 32
        n_blocks = depth // bs + 1
        k_cache, v_cache, k_scale, v_scale = stored_cache(rng, KVDtype.F16, n_blocks, n_kv, bs, hd)
        tables = np.arange(n_blocks, dtype=np.int64).reshape(1, n_blocks)
        positions = np.array([depth], np.int64)
        chunk = np.zeros(1, np.int64)
        q = f32(rng, 1, n_kv * group, hd)
        plan = attention.plan_attention(positions, chunk, 0, n_kv, n_kv * group, hd)
        got = {}
        for driver, n_lanes in ((attention._attend_serial, 1), (attention._attend, lanes)):
            parts = np.full_like(plan.parts, np.nan)  # an item never run stays NaN
            counter = np.zeros(1, np.int64)
            driver(
                q, k_cache, v_cache, k_scale, v_scale, positions, chunk, tables, 0,
                np.float32(0.3), plan.items, plan.first_seg, plan.base, plan.seg_len,
                parts, counter, n_lanes,
            )  # fmt: skip
            got[driver] = parts
        n_items = len(plan.items)
        assert not np.isnan(got[attention._attend]).any()
        np.testing.assert_array_equal(got[attention._attend], got[attention._attend_serial])
        assert counter[0] == n_items + lanes  # each lane's last claim found nothing
    finally:
        attention.SEGMENT_POSITIONS = saved


@settings(max_examples=10, deadline=None)
@given(
    dtype=st.sampled_from([KVDtype.F32, KVDtype.F16]),
    head_dim=st.sampled_from([16, 64, 96]),
    length=st.integers(1, 130),
    seed=st.integers(0, 2**32 - 1),
)
def test_values_read_in_place_never_touch_positions_past_the_row(
    dtype: KVDtype, head_dim: int, length: int, seed: int
) -> None:
    """Blocks of 32 f32/f16 positions: the V product reads whole tiles from the pool
    itself (``attention._values_in_place``); a tile past the row's last position
    must still be loaded, its tail zeroed, since weight 0 times the NaN of an
    unwritten position is NaN. The pool's positions past ``length`` and V's
    padding columns hold NaN (f16: NaN's half bits, which widen to a NaN): the
    row's output keeps its bits."""
    rng = rng_for(seed)
    n_kv, group, bs = 2, 3, 32
    n_blocks = -(-length // bs) + 1  # one block more than the row needs
    k_cache, v_cache, k_scale, v_scale = stored_cache(rng, dtype, n_blocks, n_kv, bs, head_dim)
    tables = np.arange(n_blocks, dtype=np.int64).reshape(1, n_blocks)
    q = f32(rng, 1, n_kv * group, head_dim)
    pos = np.array([length - 1], np.int64)
    scale = np.float32(0.3)

    def attend(v: np.ndarray) -> np.ndarray:
        out = np.empty_like(q)
        kernels.paged_attention(
            q, k_cache, v, pos, np.zeros(1, np.int64), tables, 0, scale, out, k_scale, v_scale
        )
        return out

    clean = attend(v_cache)
    poison = np.float32(np.nan) if dtype is KVDtype.F32 else np.int16(0x7E00)  # a NaN half
    dirty = v_cache.copy()
    tail = np.arange(length, n_blocks * bs)  # positions no row has written
    dirty[tail // bs, :, :, tail % bs, :] = poison
    dirty[..., head_dim % V_PANEL or V_PANEL :][:, :, -1:] = poison  # the last panel's padding
    assert attend(dirty).tobytes() == clean.tobytes()
    assert np.isfinite(clean).all()


def test_a_positions_values_read_back_from_the_panels_they_were_stored_in() -> None:
    """``PagedKVCache.values`` and ``position`` find what ``store_kv`` put in V's panels."""
    rng = rng_for(7)
    hd, n_kv, bs = 48, 2, 4  # 48: one whole panel and one half-padded
    kv = PagedKVCache(tiny_config(n_kv, hd), 3, bs, KVDtype.F32)
    assert kv.v.shape == (1, 3, n_kv, 2, bs, V_PANEL)
    x = f32(rng, 1, n_kv, hd)
    block, offset = np.array([2], np.int64), np.array([1], np.int64)
    kernels.store_kv(x, x, kv.k[0], kv.v[0], block, offset)
    np.testing.assert_array_equal(kv.values(0, 2, 1), x[0])
    k_at, v_at = kv.position(0, 2, 1)
    np.testing.assert_array_equal(k_at, x[0])
    assert v_at.shape == (n_kv, 2, V_PANEL)
    np.testing.assert_array_equal(v_at.reshape(n_kv, -1)[:, :hd], x[0])
    assert not v_at[:, 1, hd - V_PANEL :].any()  # padding


@settings(max_examples=40, deadline=None)
@given(x=st.floats(-87.0, 0.0, width=32))
def test_the_softmax_exp_is_exactly_one_at_zero_and_close_to_numpys_elsewhere(x: float) -> None:
    """``attention._exp(0) == 1`` exactly: a tile that leaves a row's max where it was
    skips its rescale (``alpha`` would be ``_exp(0)``; ``x * 1`` is ``x``), and a
    single segment merges unchanged; both are the same bits only because of it."""
    exp = attention._exp
    assert exp(np.float32(0.0)) == np.float32(1.0)
    got, want = exp(np.float32(x)), np.exp(np.float64(np.float32(x)))
    assert abs(got - want) <= 4 * np.spacing(np.float32(want))  # the ~2 ulp of its comment


@njit(cache=False)
def _both_products(x, w, pf, pf_at, plain, prefetching, k_in, ncols):  # type: ignore[no-untyped-def]
    attention._rows_times_panel(x, w, plain, 0, k_in, ncols)
    attention._rows_times_panel_pf(x, w, prefetching, 0, k_in, ncols, pf, pf_at)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20),
    k_in=st.integers(1, 130),
    ncols=st.integers(1, 32),
    f16=st.booleans(),
    far=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_tiles_that_prefetch_the_next_tile_give_the_same_bits(
    rows: int, k_in: int, ncols: int, f16: bool, far: int, seed: int
) -> None:
    """The products of a K/V tile read in place ask for the next tile's lines
    meanwhile (``attention._rows_times_panel_pf``, matmul's ``prefetch_from``): a
    hint that must change no bit of the product, for every row count (the first
    tile of 8 prefetches, the rest do not) and wherever the next tile is, even
    past the end of the pool (a prefetch never faults)."""
    rng = rng_for(seed)
    x = f32(rng, rows, k_in)
    w32 = f32(rng, 1, k_in, 32)
    w = w32.astype(np.float16).view(np.int16) if f16 else w32
    pf = f32(rng, 4, k_in, 32).astype(w.dtype)
    pf_at = far * pf.size  # 0: inside; 1: just past the end; 2, 3: far past it
    plain = np.full((rows, 32), np.nan, np.float32)
    prefetching = np.full((rows, 32), np.nan, np.float32)
    _both_products(x, w, pf, pf_at, plain, prefetching, k_in, ncols)
    assert prefetching.tobytes() == plain.tobytes()
    assert np.isfinite(plain[:, :ncols]).all()
