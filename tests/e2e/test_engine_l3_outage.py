"""An L3 outage on a real engine: Redis killed mid-run. Every request still
completes with identical outputs within its prefetch deadline; after a
restart, hits come back by themselves. With the circuit breaker off: what
requests see of the dead store itself (the breaker's own outage tests are
in test_engine_l3_breaker.py)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.engine_utils import (
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    settle_backups,
)
from tests.storage.redis.services import RedisServer

pytestmark = pytest.mark.engine


def test_redis_outage_costs_misses_not_answers(tiny_model_dir, reference, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    extra = {
        "hicache_io_backend": "direct",
        "hicache_storage_backend": "redis",
        "hicache_storage_prefetch_policy": "timeout",
        "l3_breaker": False,
        "hicache_storage_backend_extra_config": {
            "url": server.url, "socket_timeout_s": 0.5, "prefetch_threshold": 32,
            "prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.0,
        },
    }
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        settle_backups(llm)
        server.kill()
        assert llm.reset_prefix_cache(reset_connector=True)
        start = time.monotonic()
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        # Only vLLM's own cache (the 64-token shared prefix, for 2 of the 3
        # requests, in whichever order they ran): L2 was cleared, L3 is down.
        assert sorted(cached) == [0, 64, 64]
        assert time.monotonic() - start < 15
        # Restart (same port, empty). Pages whose backup failed are not
        # retried, so hits resume for what is computed from now on.
        server.start()
        fresh = [[5 + (i * 11) % 470 for i in range(100)], [9 + (i * 13) % 470 for i in range(130)]]
        cold, _ = generate(llm, fresh)
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)
        outputs, cached = generate(llm, fresh)
        assert outputs == cold
        assert cached == [96, 128]
        assert scheduler_half(llm).l3.prefetched_blocks > 0
    finally:
        close(llm)
        server.kill()
