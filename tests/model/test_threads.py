"""The threading set-up: briefly polling OpenMP workers inside, nothing left for child processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A child imports the kernels, runs one parallel kernel, then starts a grandchild
# that prints whether it inherited the variable. OMP_DISPLAY_ENV makes libgomp
# print the wait policy it read when it loaded, on stderr.
_CHILD = """
import os, subprocess, sys
import numpy as np
import triollm.model.matmul, triollm.model.kernels, triollm.model.quant
from triollm.model import kernels
x = np.ones((2, 8), np.float32); out = np.empty_like(x)
kernels.rms_norm(x, np.ones(8, np.float32), np.float32(1e-5), out)
print("self", os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
grandchild = (
    "import os; print('child', os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
)
sys.stdout.flush()
subprocess.run([sys.executable, "-c", grandchild], check=True)
"""


def _run(preset: str | None, spin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # VERBOSE adds libgomp's GOMP_SPINCOUNT line
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    return subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )


def test_the_runtime_polls_briefly_then_sleeps_and_no_child_inherits_the_setting() -> None:
    # Unbounded polling made a shared-core step 10x slower and pure sleeping made a
    # region cost a wake-up (docs/performance.md, engine.md), so the runtime must read
    # PASSIVE with our short spin count; but a peer benchmark started from this process
    # inherited the variable and ran handicapped, so neither may stay in os.environ.
    out = _run(None)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr
    assert f"GOMP_SPINCOUNT = '{threads.SPIN_COUNT}'" in out.stderr
    assert out.stdout.split("\n")[:2] == ["self None None", "child None None"]


@pytest.mark.parametrize("preset", ["ACTIVE", "PASSIVE"])
def test_a_wait_policy_the_user_chose_wins_and_stays_theirs(preset: str) -> None:
    out = _run(preset)
    assert f"OMP_WAIT_POLICY = '{preset}'" in out.stderr
    # our spin count is not added to the user's policy: ACTIVE polls without end,
    # PASSIVE not at all (libgomp's own reading of the policy)
    assert f"GOMP_SPINCOUNT = '{threads.SPIN_COUNT}'" not in out.stderr
    assert out.stdout.split("\n")[:2] == [f"self {preset} None", f"child {preset} None"]


def test_a_spin_count_the_user_chose_wins_and_stays_theirs() -> None:
    out = _run(None, spin="12345")
    assert "GOMP_SPINCOUNT = '12345'" in out.stderr
    assert out.stdout.split("\n")[:2] == ["self None 12345", "child None 12345"]


# --- on_calling_thread: a small product without a parallel region ---------------------

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from triollm.model import matmul, quant, threads  # noqa: E402
from triollm.model.quant import QuantType, quantize, stack_rows  # noqa: E402


@njit(nogil=True, parallel=True)
def _who_ran(ids: np.ndarray) -> None:  # pragma: no cover - numba
    for i in prange(ids.shape[0]):
        ids[i] = numba.get_thread_id()


def test_a_kernel_on_the_calling_thread_runs_every_item_there_and_the_team_comes_back() -> None:
    if numba.get_num_threads() < 2:
        pytest.skip("one numba thread: nothing to keep off")
    ids = np.full(64, -1, np.int64)
    _who_ran(ids)
    assert len(set(ids.tolist())) >= 2  # the team split the items
    before = numba.get_num_threads()
    ids[:] = -1
    threads.on_calling_thread(_who_ran, ids)
    assert set(ids.tolist()) == {0}  # no worker was woken: every item on this thread
    assert numba.get_num_threads() == before == threads.thread_count()


def test_the_team_comes_back_when_the_kernel_raises() -> None:
    before = numba.get_num_threads()

    def boom() -> None:
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError):
        threads.on_calling_thread(boom)
    assert numba.get_num_threads() == before


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    # counts the calls that run on the calling thread: a kernel with the team set
    # to one, or the int8 product's one-row kernel (no prange at all)
    calls: list[int] = []
    real = threads.on_calling_thread
    one_row = quant._int8_one_row

    def spy(kernel: object, *args: object) -> object:
        calls.append(1)
        return real(kernel, *args)  # type: ignore[arg-type]

    def spy_one_row(*args: object) -> None:
        calls.append(1)
        one_row(*args)

    monkeypatch.setattr(threads, "on_calling_thread", spy)
    monkeypatch.setattr(quant, "_int8_one_row", spy_one_row)
    return calls


def test_a_one_row_products_arguments_are_made_once_per_weight_and_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # quant.linear keeps a batch-1 product's kernel arguments and split decision per
    # weight, keyed by threads.SERIAL_MAX_BYTES: made on the first call, reused after,
    # and made again when a benchmark changes the threshold (never a stale decision).
    rng = np.random.default_rng(3)
    w = matmul.prepare(quantize(rng.standard_normal((64, 64)).astype(np.float32), QuantType.Q8_0))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    made: list[object] = []
    real = quant._one_row_args

    def spy(weight: object) -> object:
        made.append(threads.SERIAL_MAX_BYTES)
        return real(weight)  # type: ignore[arg-type]

    monkeypatch.setattr(quant, "_one_row_args", spy)
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 0)
    first = [matmul.linear(x, w) for _ in range(3)]
    assert made == [0]
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 1 << 40)
    again = matmul.linear(x, w)
    assert made == [0, 1 << 40]
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 0)
    matmul.linear(x, w)
    assert made == [0, 1 << 40]  # each threshold's arguments kept
    for out in first:
        np.testing.assert_array_equal(out, again)


@pytest.mark.parametrize("kind", ["q8_0", "stack", "exact", "bf16"])
def test_only_one_row_times_a_small_weight_runs_serially_and_the_bits_are_the_same(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The serial path is one thread running the same compiled kernel: the bits of
    # every row must equal the parallel path's, and only a one-row product below
    # the threshold may take it (a batch, or a weight above it, keeps the team).
    rng = np.random.default_rng(7)
    raw = rng.standard_normal((96, 64)).astype(np.float32)
    if kind == "bf16":
        w = matmul.prepare((raw.view(np.uint32) >> np.uint32(16)).astype(np.uint16), bf16=True)
    elif kind == "stack":
        parts = [quantize(raw[:64], QuantType.Q8_0), quantize(raw[64:], QuantType.Q4_1)]
        w = matmul.prepare(stack_rows(parts))
    else:
        q = quantize(raw, QuantType.Q8_0)
        w = matmul.prepare(q.with_exact_activations(kind == "exact"))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 0)
    parallel = [matmul.linear(x[i : i + 1], w) for i in range(3)]
    assert calls == []
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", w.nbytes)  # the override: every path
    serial = [matmul.linear(x[i : i + 1], w) for i in range(3)]
    assert len(calls) == 3
    batch = matmul.linear(x, w)  # three rows: the team, whatever the threshold
    assert len(calls) == 3
    for i in range(3):
        np.testing.assert_array_equal(serial[i], parallel[i])
        np.testing.assert_array_equal(serial[i][0], batch[i])


def test_a_few_rows_looked_up_run_serially_and_equal_the_same_rows_of_a_long_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the embedding lookup of a decode step (a token or a few) opens no region;
    # a prefill's many tokens keep the team; a row's values are the same either way
    rng = np.random.default_rng(3)
    w = quantize(rng.standard_normal((64, 64)).astype(np.float32), QuantType.Q4_1)
    many = np.arange(40, dtype=np.int64) % 64
    calls = _spy(monkeypatch)
    everything = w[many]
    assert calls == []
    for i in (0, 5, 39):
        np.testing.assert_array_equal(w[many[i : i + 1]][0], everything[i])
    assert len(calls) == 3


def test_the_one_row_product_releases_the_gil_and_is_cached() -> None:
    # it runs inside a server's forward (a worker thread beside the event loop)
    assert quant._int8_one_row.targetoptions["nogil"] is True
    assert quant._int8_one_row._cache.__class__.__name__ == "FunctionCache"
    assert not quant._int8_one_row.targetoptions.get("parallel")  # no prange: no region


# --- which one-row products are split: each path's break-even ---------------------------


def test_a_path_splits_from_where_the_second_core_saves_more_than_a_region_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # B > R / (1/b1 - 1/b2): at the break-even the saving equals the region's cost
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", None)
    b1 = 13.0
    edge = threads.split_min_bytes(b1)
    saved_us = edge * (1 / b1 - 1 / threads.TWO_THREADS_GBS) / 1000
    assert saved_us == pytest.approx(threads.REGION_US)
    assert not threads.split_pays(int(edge) - 1, b1)
    assert threads.split_pays(int(edge) + 1, b1)
    # a slower path (more work per byte) splits smaller weights than a faster one
    assert threads.split_min_bytes(10.0) < edge < threads.split_min_bytes(19.0)
    # one thread as fast as two: never worth a region
    assert threads.split_min_bytes(threads.TWO_THREADS_GBS) == float("inf")
    # a benchmark's override decides for every path
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 0)
    assert threads.split_pays(1, b1)


def test_a_16_bit_product_is_split_from_a_smaller_weight_than_an_int8_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the default rule, as each path calls it: a 1.1 MB bf16 weight (SmolLM2's
    # q/k/v) is split, a 0.59 MB Q8_0 one (the same q/k/v) runs on this thread
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", None)
    assert threads.split_pays(1_105_920, matmul._ONE_THREAD_GBS["bfloat16"])
    assert not threads.split_pays(587_520, quant.INT8_ONE_THREAD_GBS)
    rng = np.random.default_rng(11)
    raw = rng.standard_normal((960, 576)).astype(np.float32)
    bf16 = matmul.prepare((raw.view(np.uint32) >> np.uint32(16)).astype(np.uint16), bf16=True)
    q8 = matmul.prepare(quantize(raw, QuantType.Q8_0))
    x = rng.standard_normal((1, 576)).astype(np.float32)
    calls = _spy(monkeypatch)
    matmul.linear(x, bf16)
    assert calls == []  # split: no team of one
    matmul.linear(x, q8)
    assert len(calls) == 1  # the one-row int8 kernel on this thread


@pytest.mark.parametrize("kind", ["bf16", "f16", "q8_0", "stack"])
@pytest.mark.parametrize("n_out", [960, 576, 96 + 16])
def test_a_claimed_split_of_one_row_gives_the_bits_of_the_serial_product_and_of_a_batch(
    kind: str, n_out: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The split one-row products hand out runs of panels (or weight-row groups) to
    # whichever thread claims next; 30 or 18 panels end in a short run of single
    # panels. Whoever ran a run, and in whichever tile, every column must have the
    # bits of the serial product and of the same row inside a batch.
    rng = np.random.default_rng(n_out)
    raw = rng.standard_normal((n_out, 128)).astype(np.float32)
    if kind == "bf16":
        w = matmul.prepare((raw.view(np.uint32) >> np.uint32(16)).astype(np.uint16), bf16=True)
    elif kind == "f16":
        w = matmul.prepare(raw.astype(np.float16))
    elif kind == "stack":
        cut = n_out // 32 * 16
        parts = [quantize(raw[:cut], QuantType.Q8_0), quantize(raw[cut:], QuantType.Q4_1)]
        w = matmul.prepare(stack_rows(parts))
    else:
        w = matmul.prepare(quantize(raw, QuantType.Q8_0))
    x = rng.standard_normal((5, 128)).astype(np.float32)
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 0)
    split = [matmul.linear(x[i : i + 1], w) for i in range(5)]
    monkeypatch.setattr(threads, "SERIAL_MAX_BYTES", 1 << 40)
    serial = [matmul.linear(x[i : i + 1], w) for i in range(5)]
    batch = matmul.linear(x, w)
    for i in range(5):
        np.testing.assert_array_equal(split[i], serial[i])
        np.testing.assert_array_equal(split[i][0], batch[i])
