"""The KV-cache manager's claims (refcounts, one writer, content, salts, events), by hypothesis."""

from __future__ import annotations

from .kvcache_machine import KVCacheMachine

TestKVCache = KVCacheMachine.TestCase
