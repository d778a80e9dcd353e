"""The process's threading set-up for the parallel kernels: one owner, and no leak.

numba runs every ``prange`` kernel on an OpenMP runtime (libgomp here). By default
its workers spin-wait between parallel regions; a forward pass opens ~120 regions
per step, and on the shared 2-core target spinning workers stole the cores the
working ones needed (a step ran 10x slower; docs/performance.md). Passive waiting
costs a futex wake-up per region instead.

libgomp reads ``OMP_WAIT_POLICY`` once, when the library is loaded. So
:func:`start_parallel_runtime` puts the variable in the environment only for that
moment: it sets it (unless the user chose a value), loads numba's threading layer,
and takes the variable back out.

Hazard: the variable must not stay in ``os.environ``. Every child process inherits
it, and a peer started from a benchmark (llama.cpp is built with OpenMP too) then
runs with sleeping workers, a configuration nobody uses: the last wave's GGUF verdict
compared against a handicapped peer exactly so. ``tests/model/test_threads.py`` holds
both halves: the runtime starts passive, and no child sees the variable.
"""

from __future__ import annotations

import os
import threading

_WAIT_POLICY = "OMP_WAIT_POLICY"
_started = False
_lock = threading.Lock()


def start_parallel_runtime() -> None:
    """Load numba's threading layer with passive OpenMP workers; idempotent.

    Call it before the first parallel kernel runs (the kernel modules call it on
    import). A value of ``OMP_WAIT_POLICY`` the user set wins and stays where the
    user put it; ours is removed again once the runtime has read it.
    """
    global _started
    with _lock:
        if _started:
            return
        ours = _WAIT_POLICY not in os.environ
        if ours:
            os.environ[_WAIT_POLICY] = "PASSIVE"
        try:
            # Trap: a private numba function, but the one that loads the layer (and
            # with it libgomp, which reads the variable in its constructor); the first
            # prange call would otherwise load it later, after we took the value back.
            from numba.np.ufunc import parallel

            parallel._launch_threads()
        finally:
            if ours:
                del os.environ[_WAIT_POLICY]
        _started = True
