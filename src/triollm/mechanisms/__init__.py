"""Runnable demonstrations of the book section's mechanisms: ``triollm demo NAME``.

Each demonstration starts what it needs in-process, shows one mechanism happening
with figures it measures as it runs, and ends by itself. Where the point is an exact
interleaving (who was woken, which step dropped whom) it runs on trio's
``MockClock`` so the story prints the same lines every time; ``tests/mechanisms/``
runs every one of them and checks the lines the docs quote.

The registry below is the one list of demonstrations: the command, its ``--help`` and
the tests read it.
"""

from __future__ import annotations

# name -> (module, one-line description). Imported only when chosen.
DEMOS: dict[str, tuple[str, str]] = {
    "slow-client": (
        "triollm.mechanisms.slow_client",
        "non-blocking dispatch: a full per-request buffer cuts the slow client, not the batch",
    ),
    "batching": (
        "triollm.mechanisms.batching",
        "decode throughput against batch size, beside the (W + B·A)/β floor, measured",
    ),
    "deadlock": (
        "triollm.mechanisms.deadlock",
        "free-slot admission locks the pool; reserving prompt + answer cannot",
    ),
    "chunked-prefill": (
        "triollm.mechanisms.chunked_prefill",
        "a long prompt among decoding streams: their longest gap, chunk 128 vs one chunk",
    ),
    "disconnect": (
        "triollm.mechanisms.disconnect",
        "a client leaving while queued, in prefill, in decode: its blocks back at once (499)",
    ),
    "overload": (
        "triollm.mechanisms.overload",
        "a burst past the bounded queue: 429 + Retry-After at once; the wait budget: 429, not 499",
    ),
    "lost-wakeup": (
        "triollm.mechanisms.lost_wakeup",
        "one driver vs every waiter reading the capacity channel: the stall, measured",
    ),
}
