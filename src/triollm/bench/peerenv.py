"""Every system measured in its own default environment: the one launcher of peers.

A benchmark harness is a Python process that may have imported triollm (numba, an
OpenMP runtime) and numpy (OpenBLAS); any of them, or the shell that started the
harness, may have put threading variables into ``os.environ``. A child process
inherits all of them. llama.cpp is built with OpenMP, so an inherited
``OMP_WAIT_POLICY=PASSIVE`` makes its threads sleep at every barrier: the last GGUF
verdict compared triollm against a peer running in a configuration nobody uses
(issue 21, cause 1). The machine itself may set ``OPENBLAS_CORETYPE``; that is the
harness's business, not the peer's.

So every peer (``llama-batched-bench``, ``llama-bench``, ``llama-server``) and every
triollm child of the harness starts from :func:`clean_env`: the harness's
environment minus every variable with a prefix in :data:`SCRUBBED_PREFIXES`. triollm
then gets back only what it is told on purpose (:func:`triollm_env`: the thread
count both systems are given, and the source tree).

``tests/bench/test_peerenv.py`` starts a child through :func:`run` and checks that it
sees none of them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

# OpenMP (generic, GNU, Intel), numba and OpenBLAS: the runtimes triollm, numpy and
# the harness may configure. Prefixes, not names: a new variable of the same family
# is scrubbed too.
SCRUBBED_PREFIXES = ("OMP_", "GOMP_", "KMP_", "NUMBA_", "OPENBLAS_")


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without the threading variables."""
    env = os.environ if base is None else base
    return {k: v for k, v in env.items() if not k.startswith(SCRUBBED_PREFIXES)}


def scrubbed(base: Mapping[str, str] | None = None) -> list[str]:
    """The names :func:`clean_env` drops from ``base`` (recorded with each run)."""
    env = os.environ if base is None else base
    return sorted(k for k in env if k.startswith(SCRUBBED_PREFIXES))


def triollm_env(threads: int, src: str | None = None) -> dict[str, str]:
    """triollm's child: the clean environment plus its thread count (and source tree).

    ``NUMBA_NUM_THREADS`` is the one setting both systems get on purpose (llama.cpp
    gets ``-t``); triollm's own threading set-up (``model/threads.py``) does the rest,
    as it does for any user.
    """
    env = clean_env()
    env["NUMBA_NUM_THREADS"] = str(threads)
    if src is not None:
        env["PYTHONPATH"] = src
    return env


def _argv(cmd: Sequence[Any]) -> list[str]:
    return [str(c) for c in cmd]


def run(
    cmd: Sequence[Any], *, env: Mapping[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the clean environment unless ``env`` is given (which
    must itself come from :func:`clean_env` or :func:`triollm_env`)."""
    return subprocess.run(_argv(cmd), env=dict(env) if env is not None else clean_env(), **kw)


def popen(
    cmd: Sequence[Any], *, env: Mapping[str, str] | None = None, **kw: Any
) -> subprocess.Popen:
    """``subprocess.Popen`` with the clean environment (a server)."""
    return subprocess.Popen(_argv(cmd), env=dict(env) if env is not None else clean_env(), **kw)
