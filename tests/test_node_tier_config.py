"""The node tier's keys (config.py) and the backend they build
(l3/node_backend.py): a node tier alone, in front of a remote store, or not
at all; bad values and stray keys refused by name."""

from __future__ import annotations

import pytest

from tests.tmpfs import tmpfs_dir
from vllm_hicache.config import HiCacheConfig
from vllm_hicache.l3.node_backend import build_backend
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.node_chain import NodeChainBackend
from vllm_hicache.storage_config import NODE_ONLY_BACKEND

CTX = StorageContext("worker", 0, 1, 64 + 4096)
MB = 1 << 20


@pytest.fixture
def shm():
    with tmpfs_dir("hicache-node-cfg-") as path:
        yield str(path)


def test_off_by_default():
    cfg = HiCacheConfig.parse({})
    assert cfg.node_tier_bytes == 0 and cfg.storage is None


def test_a_node_tier_alone_runs_on_the_l3_machinery_with_its_knobs():
    cfg = HiCacheConfig.parse({
        "node_tier_bytes": 8 * MB, "node_tier_name": "chat-a",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"prefetch_threshold": 16}})
    assert (cfg.node_tier_bytes, cfg.node_tier_name, cfg.node_tier_root) == \
        (8 * MB, "chat-a", "/dev/shm")
    assert cfg.storage.backend == NODE_ONLY_BACKEND
    assert (cfg.storage.prefetch_policy, cfg.storage.prefetch_threshold) == \
        ("wait_complete", 16)


def test_a_node_tier_in_front_of_a_remote_store_keeps_the_remote_one():
    cfg = HiCacheConfig.parse({"node_tier_bytes": MB, "hicache_storage_backend": "file",
                               "hicache_storage_backend_extra_config": {"path": "/tmp/x"}})
    assert cfg.storage.backend == "file"


@pytest.mark.parametrize("extra, match", [
    ({"node_tier_bytes": -1}, "node_tier_bytes=-1"),
    ({"node_tier_bytes": 1.5}, "node_tier_bytes"),
    ({"node_tier_bytes": True}, "node_tier_bytes"),
    ({"node_tier_bytes": MB, "node_tier_name": "../etc"}, "node_tier_name"),
    ({"node_tier_bytes": MB, "node_tier_name": ""}, "node_tier_name"),
    ({"node_tier_bytes": MB, "node_tier_root": "shm"}, "node_tier_root"),
    ({"node_tier_name": "a"}, "node_tier_name given without node_tier_bytes"),
    ({"node_tier_bytes": 0, "node_tier_root": "/dev/shm"},
     "node_tier_root given without node_tier_bytes"),
    ({"node_tier_bytes": MB, "hicache_storage_backend": NODE_ONLY_BACKEND},
     "hicache_storage_backend"),
    ({"hicache_storage_backend_extra_config": {"prefetch_threshold": 16}},
     "without hicache_storage_backend"),
])
def test_bad_values_and_stray_keys_are_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        HiCacheConfig.parse(extra)


def node_cfg(root: str, **extra) -> HiCacheConfig:
    return HiCacheConfig.parse({"node_tier_bytes": MB, "node_tier_root": root, **extra})


def test_the_node_tier_alone_is_a_chain_without_a_remote_store(shm):
    cfg = node_cfg(shm)
    backend = build_backend(cfg, cfg.storage, CTX, "ns-a")
    try:
        assert isinstance(backend, NodeChainBackend) and backend.remote is None
        assert backend.tier.name == "default"
    finally:
        backend.close()


def test_without_a_node_tier_the_remote_store_is_used_as_it_is(tmp_path):
    cfg = HiCacheConfig.parse({"hicache_storage_backend": "file",
                               "hicache_storage_backend_extra_config": {"path": str(tmp_path)}})
    backend = build_backend(cfg, cfg.storage, CTX, "ns-a")
    try:
        assert backend.name == "file"
    finally:
        backend.close()


def test_other_identities_and_names_get_other_tiers(shm):
    cfg = node_cfg(shm)
    built = [build_backend(cfg, cfg.storage, CTX, ident) for ident in ("ns-a", "ns-a", "ns-b")]
    other = node_cfg(shm, node_tier_name="other")
    built.append(build_backend(other, other.storage, CTX, "ns-a"))
    try:
        dirs = [b.tier.directory for b in built]
        assert dirs[0] == dirs[1] and len(set(dirs)) == 3
        built[0].put(["k"], [[bytearray_page()]])
        assert built[1].exists_prefix(["k"]) == 1
        assert built[2].exists_prefix(["k"]) == 0 and built[3].exists_prefix(["k"]) == 0
    finally:
        for b in built:
            b.close()


def test_a_tier_that_cannot_be_joined_closes_the_remote_store(shm, tmp_path, monkeypatch):
    closed = []
    from vllm_hicache.storage.file.backend import FileBackend
    monkeypatch.setattr(FileBackend, "close", lambda self: closed.append(self))
    cfg = node_cfg(shm, hicache_storage_backend="file",
                   hicache_storage_backend_extra_config={"path": str(tmp_path)})
    tiny = StorageContext("worker", 0, 1, 2 * MB)  # no page fits the 1 MB tier
    with pytest.raises(Exception, match="holds no page"):
        build_backend(cfg, cfg.storage, tiny, "ns-a")
    assert len(closed) == 1


def bytearray_page():
    import numpy as np
    return np.arange(CTX.object_bytes, dtype=np.uint64).astype(np.uint8)
