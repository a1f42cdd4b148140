"""Exact L3 removal events on a real vLLM CPU engine, read as a router
would (vLLM's ZMQ publisher, a SUB socket): with the file backend's
``max_bytes`` LRU evicting, and with Redis evicting under ``maxmemory``
(keyspace notifications on), the STORAGE blocks the events leave standing
are exactly the blocks whose objects are in the store."""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.e2e.engine_utils import BLOCK_SIZE, close, generate, make_llm, scheduler_half
from tests.e2e.test_engine_events import TOPIC, drain
from tests.e2e.test_engine_write_budget import block_bytes
from tests.storage.redis.services import RedisServer
from vllm_hicache.l3.canary import is_canary_key

pytestmark = pytest.mark.engine

OBJECTS = 10  # the store holds about this many blocks' objects
# Redis counts its clients' buffers in the memory ``maxmemory`` bounds: about
# 41 KiB per idle connection on Redis 7.0, more than one object. With the
# default pool of 16 connections a busy engine's clients alone outgrew the
# room for OBJECTS objects, and LRU emptied the store (CI, 2026-12-04). So the
# pool is bounded and its connections are budgeted beside the objects.
REDIS_CONNECTIONS = 2
REDIS_CLIENT_BYTES = 64 << 10


def converted(raw: bytes) -> int:
    """A block hash as vLLM's events carry it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return int.from_bytes(raw, byteorder="big") & ((1 << 64) - 1)


def standing(events, medium: str) -> set:
    """Blocks whose last event for ``medium`` says stored."""
    state: dict = {}
    for e in events:
        if getattr(e, "medium", None) != medium:
            continue
        stored = type(e).__name__ == "BlockStored"
        for h in e.block_hashes:
            state[h] = stored
    return {h for h, present in state.items() if present}


def blocks_of(keys) -> set:
    """The block hashes of object keys (...-<hash hex>), canaries left out."""
    return {converted(bytes.fromhex(k.rsplit("-", 1)[1])) for k in keys if not is_canary_key(k)}


@contextlib.contextmanager
def file_store(tmp_path, one: int):
    root = tmp_path / "l3"
    yield ({"path": str(root), "max_bytes": OBJECTS * one},
           lambda: blocks_of(p.stem for p in root.rglob("*.hckv")))


@contextlib.contextmanager
def redis_store(tmp_path, one: int):
    server = RedisServer(tmp_path / "redis", "--maxmemory-policy", "allkeys-lru",
                         "--notify-keyspace-events", "Exe").start()
    try:
        client = server.client()
        used = int(client.info("memory")["used_memory"])
        # Room for about OBJECTS objects beyond what an empty server uses, plus
        # the engine's connections: its pool and its keyspace subscriber. One
        # object per pipeline keeps a write's query buffer about one object.
        clients = (REDIS_CONNECTIONS + 1) * REDIS_CLIENT_BYTES
        client.config_set("maxmemory", used + OBJECTS * (one + 256) + clients)
        yield ({"url": server.url, "key_prefix": "hc:",
                "max_connections": REDIS_CONNECTIONS, "batch_bytes": one},
               lambda: blocks_of(k.decode()[3:] for k in client.scan_iter(match="hc:*")))
    finally:
        server.kill()


@pytest.mark.parametrize("backend, store", [("file", file_store), ("redis", redis_store)])
def test_l3_evictions_are_announced_exactly(tiny_model_dir, tmp_path, backend, store):
    with store(tmp_path, block_bytes(tiny_model_dir)) as (options, in_store_now):
        events, in_store = run_with_events(tiny_model_dir, tmp_path, {
            "hicache_io_backend": "direct", "hicache_mem_layout": "page_first_direct",
            "hicache_storage_backend": backend, "hicache_storage_backend_extra_config": options,
            # The breaker's health check rewrites one object every second: in a
            # full store each write may evict a block after the events were read.
            "l3_breaker": False,
        }, in_store_now)
    removed = [e for e in events if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"]
    assert removed, "no L3 removal was announced"
    assert all(e.ownership == backend for e in removed)
    assert 0 < len(in_store) < PROMPTS * BLOCKS_EACH
    # The router's view is the store's: nothing announced gone is there,
    # nothing there is missing from what stands.
    assert standing(events, "STORAGE") == in_store


PROMPTS, BLOCKS_EACH = 6, 5  # three times what the store holds
SETTLE_ROUNDS = 10  # at most this many small requests for the last acks


def run_with_events(model_dir, tmp_path, extra: dict, in_store_now) -> tuple[list, set]:
    """Serve PROMPTS prompts of BLOCKS_EACH full blocks; every KV event
    published, and the store's blocks once the events account for them (or
    after SETTLE_ROUNDS rounds, for the caller's assertions to judge)."""
    import zmq
    from vllm.config import KVEventsConfig

    endpoint = f"ipc://{tmp_path}/kv-events"
    llm = make_llm(model_dir, extra, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC.decode()))
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        time.sleep(0.5)  # PUB/SUB: subscribed before anything is published
        for k in range(PROMPTS):
            prompt = [5 + (i * 11 + 37 * k) % 470 for i in range(BLOCKS_EACH * BLOCK_SIZE + 1)]
            generate(llm, [prompt], max_tokens=1)
        events: list = []
        for _ in range(SETTLE_ROUNDS):  # the last backups' acks and removals come back
            time.sleep(0.3)
            generate(llm, [[7, 8, 9]], max_tokens=1)
            events += drain(sub)
            in_store = in_store_now()
            if in_store and standing(events, "STORAGE") == in_store:
                break
        assert scheduler_half(llm).l3.l3_removed_blocks > 0
        return events, in_store
    finally:
        sub.close(linger=0)
        close(llm)
