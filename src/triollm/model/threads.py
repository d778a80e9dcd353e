"""The process's threading set-up for the parallel kernels: one owner, and no leak.

numba runs every ``prange`` kernel on an OpenMP runtime (libgomp here). A forward
pass opens ~120 regions per step, and between two regions the other worker waits.
How it waits decides what a region costs:

- libgomp's default polls for up to 300 000 rounds (~16 ms here) before it sleeps.
  On the shared 2-core target a polling worker held the core its partner needed to
  finish the region (a step ran 10x slower; docs/performance.md).
- Passive waiting (``OMP_WAIT_POLICY=PASSIVE``, no polling) costs a futex wake-up
  and a sleep per region instead: ~600 sleeps per SmolLM2 batch-4 step, which took
  34 ms where the same work with a polling worker took 11-15 ms.
- So the worker polls a short while, :data:`SPIN_COUNT` rounds (~55 us at the
  ~55 ns a round measured here), then sleeps. That covers the gaps inside a step
  (Python between two products: tens of microseconds) and bounds what a poll can
  steal from a busy machine to that, per region. docs/engine.md ("The step's fixed
  costs") has the A/B.

libgomp reads both variables once, when the library is loaded. So
:func:`start_parallel_runtime` puts them in the environment only for that moment:
it sets them (unless the user chose either), loads numba's threading layer, and
takes them back out.

Hazard: the variables must not stay in ``os.environ``. Every child process inherits
them, and a peer started from a benchmark (llama.cpp is built with OpenMP too) then
runs with sleeping workers, a configuration nobody uses: the last wave's GGUF verdict
compared against a handicapped peer exactly so. ``tests/model/test_threads.py`` holds
both halves: the runtime starts with our values, and no child sees them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

_WAIT_POLICY = "OMP_WAIT_POLICY"
_SPIN_COUNT = "GOMP_SPINCOUNT"

# How many rounds a waiting OpenMP worker polls before it sleeps (the module's
# docstring has why). Measured A/B in docs/engine.md; a user's GOMP_SPINCOUNT or
# OMP_WAIT_POLICY replaces it.
SPIN_COUNT = 1000

# Which one-row products (a batch-1 decode step) are split over the team, and which
# run on the calling thread (:func:`on_calling_thread`): :func:`split_pays`. The
# second core halves a product's streaming only up to what two cores read together,
# and the region costs a wake-up and a join; so a product is split when the time the
# second core saves is more than the region costs. Each product path knows how fast
# one thread streams its weights (the 16-bit float panels ~13 GB/s, the int8 types
# ~19: matmul.py, quant.py), so the threshold follows the path's cost per byte, not
# a model. The two constants come from the quiet sweep of 2026-12-02 16:32 (bf16 and
# Q8_0 SmolLM2 steps under four thresholds; docs/engine.md, "Which one-row products
# to split" and "Each path's break-even"): with two threads at ~30 GB/s (the
# streaming probe's median) both fit a region at 15-27 us.
REGION_US = 20.0
TWO_THREADS_GBS = 30.0
# A benchmark's override (bench_engine.py --serial-max-bytes): a one-row product of
# at most this many bytes runs on the calling thread, whatever its path; 0 splits
# every product. None: each path's break-even (split_min_bytes). Read at each call.
SERIAL_MAX_BYTES: int | None = None


def split_min_bytes(one_thread_gbs: float) -> float:
    """The weight size from which splitting a one-row product over two threads pays.

    One thread streams ``B`` bytes in ``B / b1``; two in ``B / b2 + R`` (``b2``:
    :data:`TWO_THREADS_GBS`, ``R``: :data:`REGION_US`). Splitting pays when
    ``B > R / (1/b1 - 1/b2)``. A path whose one thread already streams as fast as
    two never splits (``inf``). Trap: ``b1`` is the path's *quiet* one-thread rate
    from memory, not from L2; a rate from hot weights makes every product serial.
    """
    gain_ns_per_byte = 1.0 / one_thread_gbs - 1.0 / TWO_THREADS_GBS  # 1 GB/s = 1 byte/ns
    if gain_ns_per_byte <= 0.0:
        return float("inf")
    return REGION_US * 1000.0 / gain_ns_per_byte


def split_pays(nbytes: int, one_thread_gbs: float) -> bool:
    """Whether a one-row product of ``nbytes`` of weights should open a parallel region.

    ``one_thread_gbs`` is how fast one thread streams this product's weights (its
    path's constant). :data:`SERIAL_MAX_BYTES`, when a benchmark set it, decides
    instead. Either way only the team changes, never the bits: every output element
    is computed whole by one thread.
    """
    if SERIAL_MAX_BYTES is not None:
        return nbytes > SERIAL_MAX_BYTES
    return nbytes > split_min_bytes(one_thread_gbs)


_started = False
_lock = threading.Lock()


def start_parallel_runtime() -> None:
    """Load numba's threading layer with briefly polling OpenMP workers; idempotent.

    Call it before the first parallel kernel runs (the kernel modules call it on
    import). A wait policy or spin count the user set wins (either one: then both
    stay exactly as the user left them); ours are removed again once the runtime
    has read them.
    """
    global _started
    with _lock:
        if _started:
            return
        ours = _WAIT_POLICY not in os.environ and _SPIN_COUNT not in os.environ
        if ours:
            os.environ[_WAIT_POLICY] = "PASSIVE"
            os.environ[_SPIN_COUNT] = str(SPIN_COUNT)
        try:
            # Trap: a private numba function, but the one that loads the layer (and
            # with it libgomp, which reads the variables in its constructor); the
            # first prange call would otherwise load it later, after we took them back.
            from numba.np.ufunc import parallel

            parallel._launch_threads()
        finally:
            if ours:
                del os.environ[_WAIT_POLICY]
                del os.environ[_SPIN_COUNT]
        _started = True


def _thread_count_setters() -> tuple[Any, Any]:
    """numba's raw getter and setter of this thread's parallel-thread count."""
    start_parallel_runtime()
    # Trap: private, as _launch_threads above. numba.set_num_threads validates its
    # argument in Python (~2.5 us a call here, ~1.8 us for get_num_threads); these
    # are the ctypes functions it ends in (~1 us for a set and its restore).
    from numba.np.ufunc import parallel

    return parallel._get_num_threads, parallel._set_num_threads  # type: ignore[attr-defined]


def on_calling_thread(kernel: Callable[..., Any], *args: Any) -> Any:
    """Run a ``prange`` kernel with this thread's team set to one thread, then restore it.

    A team of one opens no parallel region: libgomp runs the loop inline and wakes
    no worker. For a product too small to repay a region (a batch-1 decode step's
    small weights; :func:`split_pays`) this saves the wake-up, its
    futex sleeps and, on an idle virtual machine, the idle vCPU's exit latency. The
    kernel's bits do not depend on how many threads split its items (every item is
    computed whole by one thread), so the result is the same either way.
    Hazard: the count is numba's per-thread setting; it is restored even if the
    kernel raises, or every later region of this thread would run single-threaded.
    """
    get, set_ = _COUNT or _counts()
    saved = get()
    set_(1)
    try:
        return kernel(*args)
    finally:
        set_(saved)


def thread_count() -> int:
    """numba's thread count for this thread (``numba.get_num_threads`` without its checks)."""
    return int((_COUNT or _counts())[0]())


_COUNT: tuple[Any, Any] | None = None


def _counts() -> tuple[Any, Any]:
    global _COUNT
    _COUNT = _thread_count_setters()  # the runtime starts here if nothing started it
    return _COUNT
