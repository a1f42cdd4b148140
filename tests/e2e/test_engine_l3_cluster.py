"""A Redis Cluster (three masters, three replicas, started here) as L3 of a
real vLLM engine: answers unchanged, the pages spread over every master,
and after L2 is cleared the prefix comes back from the cluster as L3 hits."""

from __future__ import annotations

import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    settle_backups,
)
from tests.storage.redis.cluster_services import LocalCluster

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_cluster_as_l3_serves_hits(tiny_model_dir, reference, tmp_path):
    cluster = LocalCluster(tmp_path / "cluster").start()
    extra = {
        "hicache_io_backend": "direct",
        "hicache_storage_backend": "redis",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {
            "url": cluster.seed_url, "cluster": True, "key_prefix": "engine:",
            "cluster_nodes": [f"127.0.0.1:{srv.port}" for srv in cluster.servers[1:3]],
            "prefetch_threshold": 32,
        },
    }
    prompts = prompts_with_shared_prefix()
    llm = make_llm(tiny_model_dir, extra)
    try:
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        settle_backups(llm)
        per_master = {}
        for port in cluster.masters():
            client = cluster.client(port)
            try:
                per_master[port] = len(client.keys("engine:*"))
            finally:
                client.close()
        assert all(n > 0 for n in per_master.values()), per_master
        assert llm.reset_prefix_cache(reset_connector=True)  # L2 cleared, L3 kept
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert cached == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        half = scheduler_half(llm)
        assert half.l3.prefetched_blocks > 0
        assert half.stats.load_error_blocks == 0
    finally:
        close(llm)
        cluster.kill()
