"""The block pool's claims (refcounts, conservation, LRU, content), checked by hypothesis."""

from __future__ import annotations

from .pool_machine import PoolMachine

TestPool = PoolMachine.TestCase
