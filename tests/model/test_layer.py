"""The fused layer kernel (``layer.decoder_layer``): the per-product path's logits,
the same bits whatever the number of threads that really run, and a numba cache
that follows the files compiled into it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from triollm.model import layer, llama
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel, PagedKVCache
from triollm.model.weights import Checkpoint
from triollm.plan import ChunkPlan

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL_NAMES = sorted(p.name for p in (FIXTURES / "models").iterdir())


def fixture_model(name: str) -> LlamaModel:
    d = FIXTURES / "models" / name
    with Checkpoint(d) as ck:
        return LlamaModel(ModelConfig.from_dir(d), ck)


def ragged_steps(model: LlamaModel) -> list[np.ndarray]:
    """A prefill of two prompts, then a ragged step: a decode row beside a prompt's chunk."""
    rng = np.random.default_rng(7)
    kv = PagedKVCache(model.config, num_blocks=12, block_size=8)
    a = tuple(int(t) for t in rng.integers(5, 300, 21))
    b = tuple(int(t) for t in rng.integers(5, 300, 9))
    out = [
        model.forward(
            [ChunkPlan(0, a, 0, (3, 0, 5, 1), True, True), ChunkPlan(1, b, 0, (2, 4), True, True)],
            kv,
        )
    ]
    c = tuple(int(t) for t in rng.integers(5, 300, 6))
    out.append(
        model.forward(
            [
                ChunkPlan(0, (17,), 21, (3, 0, 5, 1), True, False),
                ChunkPlan(1, c, 9, (2, 4), True, True),
            ],
            kv,
        )
    )
    return out


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_fused_layer_gives_the_per_product_paths_logits(name: str) -> None:
    model = fixture_model(name)
    assert model.can_fuse, "a float checkpoint can take the fused path"
    model.fused = True
    fused = ragged_steps(model)
    model.fused = False
    unfused = ragged_steps(model)
    for f, u in zip(fused, unfused, strict=True):
        # the same sums in the same order, up to how the compiler vectorised
        # each loop in its context (exp, fused multiply-adds): float32 rounding
        np.testing.assert_allclose(f, u, rtol=0, atol=2e-6 * np.abs(u).max())
        assert (f.argmax(axis=1) == u.argmax(axis=1)).all()


def test_the_bits_do_not_depend_on_how_many_threads_really_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One participant (it claims every item itself) or more participants than
    threads (some run one after another): no deadlock, and the same bits."""
    model = fixture_model("qwen2-bias-f32")
    model.fused = True
    results = {}
    for workers in (1, 2, 5):
        monkeypatch.setattr(llama.numba, "get_num_threads", lambda w=workers: w)
        results[workers] = ragged_steps(model)
    for workers in (2, 5):
        for got, want in zip(results[workers], results[1], strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_stale_cache_is_dropped_when_a_compiled_in_file_changes(tmp_path: Path) -> None:
    module = tmp_path / "layer.py"
    for f in ("layer.py", "matmul.py", "kernels.py"):
        (tmp_path / f).write_text("")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    entry = [cache / "layer.decoder_layer-1.py311.nbi", cache / "layer.decoder_layer-1.py311.1.nbc"]
    for e in entry:
        e.write_text("")
    other = cache / "matmul.product_block-1.py311.nbi"  # another module's entry: never touched
    other.write_text("")
    os.utime(tmp_path / "matmul.py", (1000, 1000))
    os.utime(tmp_path / "kernels.py", (1000, 1000))
    for e in entry:
        os.utime(e, (2000, 2000))
    assert not layer._drop_stale_cache(module, ("matmul.py", "kernels.py"))
    assert all(e.exists() for e in entry)
    os.utime(tmp_path / "kernels.py", (3000, 3000))  # kernels.py edited after the entry
    assert layer._drop_stale_cache(module, ("matmul.py", "kernels.py"))
    assert not any(e.exists() for e in entry)
    assert other.exists()
