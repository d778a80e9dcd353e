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

# A one-row product (a batch-1 decode step) whose weight is at most this many bytes
# runs on the calling thread (:func:`on_calling_thread`), not split over the team:
# below it the parallel region costs more than the second core saves. Read at each
# call (``quant.linear``, ``matmul.linear``), so a benchmark may change it; 0 makes
# every product parallel. docs/engine.md ("The step's fixed costs") has the A/B.
SERIAL_MAX_BYTES = 2 << 20
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
    small weights; :data:`SERIAL_MAX_BYTES`) this saves the wake-up, its
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
