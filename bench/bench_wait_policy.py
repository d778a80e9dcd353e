"""What one OpenMP parallel region costs under each waiting policy, in subprocesses.

Run with ``python bench/bench_wait_policy.py``. Each policy runs in its own
process (libgomp reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, at start),
two rounds alternating, and times 2000 launches of a tiny two-thread ``prange``
kernel from a Python loop: the per-region price the per-product forward pays
~181 times a step. Wall and CPU microseconds per region, and the load average:
a spinning policy costs little on an idle machine and a great deal on a busy one.
"""

from __future__ import annotations

import os
import subprocess
import sys

POLICIES = (
    "OMP_WAIT_POLICY=PASSIVE",
    "GOMP_SPINCOUNT=1000",
    "GOMP_SPINCOUNT=10000",
    "GOMP_SPINCOUNT=100000",
    "OMP_WAIT_POLICY=ACTIVE",
)

CHILD = """
import os, statistics, sys, time
import numpy as np
from numba import njit, prange

@njit(nogil=True, parallel=True)
def k(a):
    for i in prange(a.shape[0]):
        s = 0.0
        for j in range(a.shape[1]):
            s += a[i, j]
        a[i, 0] = s * 0.0 + 1.0

a = np.ones((16, 2000), np.float32)
k(a)
runs = []
for _ in range(7):
    t, c = time.perf_counter(), time.process_time()
    for _ in range(2000):
        k(a)
    runs.append(((time.perf_counter() - t) / 2000 * 1e6, (time.process_time() - c) / 2000 * 1e6))
wall = statistics.median(r[0] for r in runs)
cpu = statistics.median(r[1] for r in runs)
print(f"| {sys.argv[1]} | {wall:.1f} | {cpu:.1f} | {os.getloadavg()[0]:.1f} |")
"""


def main() -> int:
    print(f"command: python bench/bench_wait_policy.py; {os.cpu_count()} CPUs")
    print("| policy | wall us / region | CPU us / region | load |")
    print("| --- | ---: | ---: | ---: |")
    wait_vars = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    for _ in range(2):
        for policy in POLICIES:
            key, value = policy.split("=")
            env = {k: v for k, v in os.environ.items() if k not in wait_vars}
            env[key] = value
            env.setdefault("NUMBA_NUM_THREADS", "2")
            subprocess.run([sys.executable, "-c", CHILD, policy], env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
