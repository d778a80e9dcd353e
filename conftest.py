"""The whole suite's guard: a ``trio.Cancelled`` that escapes a test fails it.

pytest-trio 0.8 ends a test as *passed* when a ``trio.Cancelled`` escapes the test
function, and the assertions after the raise never run: ``raise
trio.Cancelled._create(); assert False`` passes, even inside
``pytest.raises(ValueError)``. So code that raises a stray Cancelled where an error
was expected (a queue timeout that cancels instead of raising ``QueueTimeout``)
would go unnoticed. Every async test is wrapped here: a Cancelled (alone or as the
only kind of leaf in an exception group) that leaves the test function while no
enclosing scope is cancelled -- pytest-trio cancels the test's scope when a fixture
crashes, and then the Cancelled is legitimate -- fails the test with a message
saying so. A scope the test cancels itself catches its own Cancelled and never gets
here. Proof that the guard can fail: ``tests/test_trio_guard.py``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Generator
from typing import Any

import pytest
import trio

pytest_plugins = ["pytester"]  # tests/test_trio_guard.py runs the guard on a test file


def _only_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def guard_against_stray_cancelled(fn: Any) -> Any:
    """``fn`` (an async test), failing instead of passing when a stray Cancelled escapes."""

    @functools.wraps(fn)
    async def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            await fn(*args, **kwargs)
        except BaseException as exc:
            if _only_cancelled(exc) and trio.current_effective_deadline() != -math.inf:
                pytest.fail(
                    "trio.Cancelled escaped the test without any enclosing scope being "
                    "cancelled: code under test raised a stray Cancelled (pytest-trio "
                    "would have counted this test as passed)",
                    pytrace=True,
                )
            raise

    guarded._stray_cancelled_guard = True  # type: ignore[attr-defined]
    return guarded


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    # Before pytest-trio's own wrapper reads item.obj, so the guard runs inside its trio.run.
    fn = getattr(item, "obj", None)
    if (
        inspect.iscoroutinefunction(fn)
        and not getattr(fn, "_stray_cancelled_guard", False)
        and not hasattr(fn, "hypothesis")
    ):
        item.obj = guard_against_stray_cancelled(fn)  # type: ignore[attr-defined]
    yield
