"""Compile a client's grammar first in a child process that may crash, run out or be killed.

A grammar is a program the client sends us, and llguidance's compiler is native code
that trusts it: it recurses once per rule or schema level (a 3,000-rule chain
overflowed the server's 8 MiB worker-thread stack: SIGSEGV, every stream dead), and
some regex intersections grow without a useful bound (an ``allOf`` of 20 patterns ran
46 s and took 2.3 GB). The limits in ``constrained.py`` refuse the shapes we know;
this sandbox is for the ones we do not.

Theory of operation:

1. A :class:`GrammarSandbox` keeps up to ``workers`` child processes
   (``python -m triollm.model.grammar_sandbox``), started on first use. Each builds
   the model's vocabulary once, sets ``RLIMIT_AS`` on itself (its address space at
   rest plus ``memory_limit_bytes``), then answers one request at a time.
2. :meth:`GrammarSandbox.check` sends one grammar text; the child compiles it the
   way the server will (validation, the matcher, the first mask) on a thread whose
   stack is *half* the server's worker-thread stack, and answers ``ok`` or the
   library's error.
3. The child is killed, and the grammar refused, when it runs past
   ``time_limit_s``, when it dies (a stack overflow: SIGSEGV; memory: an allocation
   refused by ``RLIMIT_AS`` aborts it), or when ``cancel`` is set (the client left).
   A fresh child is started for the next request.

Why the server may then compile the same text itself: compiling is deterministic, so
a grammar that compiled in the child within half the stack, the memory limit and the
time limit needs no more than that in the server. The cost is a second compile on a
cache miss (a few milliseconds for an ordinary schema); the cache in
``constrained.py`` makes a repeated schema cost nothing.

Trap: a child holds the vocabulary (tens of MB for a 150k vocabulary); ``workers``
bounds how many exist. They exit on their own when the server's end of the pipe
closes (the server exited or :meth:`close`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

# The server's worker threads get the platform's default stack: RLIMIT_STACK's soft
# value (8 MiB on most Linux systems), or glibc's 2 MiB when that is unlimited.
FALLBACK_THREAD_STACK_BYTES = 2 * 1024 * 1024
# How often a waiting check looks at its cancel event (the client left).
POLL_S = 0.05
# A new child must be ready (interpreter, library, vocabulary) within this: a bound on
# a broken installation, not a timing. Its start-up is not the grammar's time.
START_LIMIT_S = 120.0
# The env variables a test sets to stand in for a runaway compile (never in production).
TEST_SLEEP_ENV = "TRIOLLM_GRAMMAR_SANDBOX_TEST_SLEEP_S"
TEST_ALLOCATE_ENV = "TRIOLLM_GRAMMAR_SANDBOX_TEST_ALLOCATE_MIB"


class SandboxRefusal(Exception):
    """The grammar was refused in the sandbox; ``deterministic`` is False for a refusal
    that the same grammar might not get again (a time limit on a busy machine, a
    client that left), so it must not be remembered."""

    def __init__(self, message: str, *, deterministic: bool) -> None:
        super().__init__(message)
        self.deterministic = deterministic


def server_thread_stack_bytes() -> int:
    """The stack a new thread of this process gets (what trio's worker threads get)."""
    configured = threading.stack_size()
    if configured:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return FALLBACK_THREAD_STACK_BYTES if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True)
class SandboxLimits:
    time_limit_s: float
    memory_limit_bytes: int
    stack_bytes: int


def _send(pipe: Any, obj: Any) -> None:
    data = json.dumps(obj).encode()
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def _read_exactly(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


class _Child:
    """One child process and its pipes."""

    def __init__(self, setup: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "triollm.model.grammar_sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                # One malloc arena: each further arena reserves 64 MiB of address
                # space, which RLIMIT_AS would count as the grammar's.
                "MALLOC_ARENA_MAX": "1",
            },
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        _send(self.stdin, setup)
        try:
            ready = self._receive(time.monotonic() + START_LIMIT_S, None)
        except SandboxRefusal:
            self.kill()
            raise SandboxRefusal(
                "cannot be compiled: the grammar sandbox did not start", deterministic=False
            ) from None
        if not ready.get("ready"):
            self.kill()
            raise SandboxRefusal(
                "cannot be compiled: the grammar sandbox did not start", deterministic=False
            )

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            self.stdin.close()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()  # type: ignore[union-attr]

    def ask(self, text: str, deadline: float, cancel: threading.Event | None) -> dict[str, Any]:
        """Send ``text``, wait for the answer; raise SandboxRefusal on any failure."""
        try:
            _send(self.stdin, {"grammar": text})
        except (BrokenPipeError, OSError):
            raise SandboxRefusal(self._death(), deterministic=True) from None
        return self._receive(deadline, cancel)

    def _receive(self, deadline: float, cancel: threading.Event | None) -> dict[str, Any]:
        while True:
            if cancel is not None and cancel.is_set():
                raise SandboxRefusal("compilation cancelled: the client left", deterministic=False)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxRefusal("", deterministic=False)  # the caller names the limit
            ready, _, _ = select.select([self.fd], [], [], min(POLL_S, left))
            if ready:
                break
        try:
            (size,) = struct.unpack("<I", _read_exactly(self.fd, 4))
            answer: dict[str, Any] = json.loads(_read_exactly(self.fd, size))
        except (EOFError, OSError, ValueError):
            raise SandboxRefusal(self._death(), deterministic=True) from None
        return answer

    def _death(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        code = self.proc.returncode
        if code == -signal.SIGSEGV:
            return "cannot be compiled: it overflows the compiler's stack (too deep or too long)"
        if code in (-signal.SIGABRT, 3):  # Rust aborts, Python exits on MemoryError
            return "cannot be compiled: it needs more memory than the limit of {mib} MiB"
        return f"cannot be compiled: the grammar compiler failed on it (exit status {code})"


class GrammarSandbox:
    """Child processes that compile a grammar before the server does (module docstring).

    Thread-safe: :meth:`check` is called from worker threads; each call takes an idle
    child (or starts one, up to ``workers``; past that it waits for one).
    """

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: SandboxLimits,
        parser_limits: dict[str, Any],
        workers: int = 2,
    ) -> None:
        self.limits = limits
        self._setup = {
            "tokenizer_json": tokenizer_json,
            "vocab_size": vocab_size,
            "eos": eos_token_ids,
            "memory_limit_bytes": limits.memory_limit_bytes,
            "stack_bytes": limits.stack_bytes,
            "parser_limits": parser_limits,
        }
        self._idle: list[_Child] = []
        self._started = 0  # children alive (idle or busy)
        self._workers = workers
        self._cond = threading.Condition()
        self.runs = 0  # grammars checked (tests read it)

    def check(self, text: str, *, cancel: threading.Event | None = None) -> None:
        """Compile ``text`` in a child; return if it compiles, else raise SandboxRefusal
        with the library's message or the limit it ran past. Blocking: call off the loop."""
        child = self._take()  # may start a child: its start-up is not the grammar's time
        deadline = time.monotonic() + self.limits.time_limit_s
        ok = False
        try:
            answer = child.ask(text, deadline, cancel)
            ok = True
        except SandboxRefusal as exc:
            if not str(exc):
                raise SandboxRefusal(
                    "cannot be compiled: it takes longer than the limit of "
                    f"{self.limits.time_limit_s:g} s",
                    deterministic=False,
                ) from None
            mib = self.limits.memory_limit_bytes // (1024 * 1024)
            raise SandboxRefusal(
                str(exc).format(mib=mib), deterministic=exc.deterministic
            ) from None
        finally:
            self._give_back(child, keep=ok)
        with self._cond:
            self.runs += 1
        if not answer.get("ok"):
            error = str(answer.get("error", "refused"))
            raise SandboxRefusal(f"is not supported: {error}", deterministic=True)

    def start(self) -> None:
        """Start one child now, so the first grammar does not wait for its start-up
        (the interpreter, the library, the vocabulary: ~1 s on a busy 2-core machine).
        Blocking: call it off the loop."""
        with self._cond:
            if self._idle or self._started >= self._workers:
                return
            self._started += 1
        try:
            child = _Child(self._setup)
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise
        self._give_back(child, keep=True)

    def _take(self) -> _Child:
        with self._cond:
            while not self._idle and self._started >= self._workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Child(self._setup)
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise

    def _give_back(self, child: _Child, *, keep: bool) -> None:
        if not keep:
            child.kill()  # its state is unknown (mid-compile, dead or over a limit)
        with self._cond:
            if keep:
                self._idle.append(child)
            else:
                self._started -= 1
            self._cond.notify()

    def close(self) -> None:
        """Stop the idle children (busy ones are stopped as their check ends)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for child in idle:
            child.kill()


# --------------------------------------------------------------------------- the child


def _child_main() -> None:
    import llguidance
    import llguidance.numpy as llnp

    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer

    def read() -> Any:
        head = stdin.read(4)
        if len(head) < 4:
            raise SystemExit(0)  # the server closed the pipe
        (size,) = struct.unpack("<I", head)
        return json.loads(stdin.read(size))

    setup = read()
    eos = setup["eos"]
    try:
        tok = llguidance.LLTokenizer(
            setup["tokenizer_json"], n_vocab=setup["vocab_size"], eos_token=eos or None
        )
    except ValueError:  # the same fallback as ConstraintTokenizer
        tok = llguidance.LLTokenizer(setup["tokenizer_json"], eos_token=eos or None)
    limits = llguidance.LLParserLimits(**setup["parser_limits"])
    del setup["tokenizer_json"]
    # The memory limit counts from here: the interpreter, the library and the vocabulary
    # are the child's own; only what one compile adds is the grammar's.
    with open("/proc/self/statm") as f:
        at_rest = int(f.read().split()[0]) * resource.getpagesize()
    # The compile thread's stack is reserved address space too.
    cap = at_rest + setup["memory_limit_bytes"] + setup["stack_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    threading.stack_size(setup["stack_bytes"])
    stdout.write(struct.pack("<I", 15) + b'{"ready": true}')
    stdout.flush()
    sleep_s = float(os.environ.get(TEST_SLEEP_ENV, "0") or 0)
    allocate_mib = int(os.environ.get(TEST_ALLOCATE_ENV, "0") or 0)

    def compile_one(text: str, out: dict[str, Any]) -> None:
        try:
            compile_checked(text, out)
        except MemoryError:
            out.clear()
            out["memory"] = True
        except Exception as exc:  # the library refused it at the API level
            out["error"] = f"{type(exc).__name__}: {exc}"

    def compile_checked(text: str, out: dict[str, Any]) -> None:
        if sleep_s:
            time.sleep(sleep_s)
        if allocate_mib:
            out["held"] = bytearray(allocate_mib * 1024 * 1024)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, tok, limits=limits
        )
        if is_error:
            out["error"] = messages[0].strip()
            return
        matcher = llguidance.LLMatcher(tok, text, log_level=0, limits=limits)
        if not matcher.is_error():
            mask = llnp.allocate_token_bitmask(1, tok.vocab_size)
            llnp.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            out["error"] = str(matcher.get_error())

    while True:
        request = read()
        out: dict[str, Any] = {}
        worker = threading.Thread(target=compile_one, args=(request["grammar"], out))
        worker.start()
        worker.join()
        if out.pop("memory", False):
            raise SystemExit(3)  # the server reads the exit status: over the memory limit
        out.pop("held", None)
        reply = {"ok": "error" not in out, "error": out.get("error")}
        data = json.dumps(reply).encode()
        stdout.write(struct.pack("<I", len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    _child_main()
