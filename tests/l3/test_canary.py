"""The start-up canary: one page of known bytes through the worker's L3 path."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.connector.mem_backend import STORES, MemBackend
from tests.kernels.kv_factory import make_kv_layers
from vllm_hicache.common.jobs import BackupJob, PrefetchJob, PrefetchProgress
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import describe_kv_tensor
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.canary import (
    CANARY_MARK,
    FAILED,
    UNAVAILABLE,
    DisabledPageStore,
    canary_hash,
    canary_pattern,
    guard_with_canary,
    is_canary_key,
    run_canary,
)
from vllm_hicache.l3.setup import build_storage_io
from vllm_hicache.l3.worker_io import StorageIO
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.format import HEADER_BYTES, encode_header
from vllm_hicache.storage.pages import PageStore

LOGGER = "vllm_hicache.l3.canary"
NS = KeyNamespace("test/model", "bfloat16", "page_first_direct", 8, 1, 0, page_format="fmt")


class FlippingBackend(MemBackend):
    """Returns every object with one payload byte flipped."""

    name = "flipping"

    def get(self, keys, targets):
        ok = super().get(keys, targets)
        for fine, bufs in zip(ok, targets):
            if fine:
                bufs[-1][7] ^= 0xFF
        return ok


class ReorderingBackend(MemBackend):
    """Stores the payload reversed and re-seals it: the object verifies but
    its bytes are not what was written (a format mismatch that checksums
    cannot see)."""

    name = "reordering"

    def put(self, keys, sources):
        resealed = []
        for key, bufs in zip(keys, sources):
            payload = np.frombuffer(b"".join(b.tobytes() for b in bufs[1:]), np.uint8)
            payload = payload[::-1].copy()
            resealed.append([encode_header(key, payload), payload])
        return super().put(keys, resealed)


class RefusingBackend(MemBackend):
    name = "refusing"

    def put(self, keys, sources):
        return [False] * len(keys)


class RaisingBackend(MemBackend):
    name = "raising"

    def put(self, keys, sources):
        raise ConnectionError("store down")


class ForgetfulBackend(MemBackend):
    """Accepts writes, then never finds them (an eviction or an outage)."""

    name = "forgetful"

    def get(self, keys, targets):
        return [False] * len(keys)


class MissingFirstGetsBackend(MemBackend):
    """A flaky store: the first ``misses`` gets fail, later ones work."""

    name = "flaky"
    misses = 1

    def get(self, keys, targets):
        if self.misses:
            self.misses -= 1
            return [False] * len(keys)
        return super().get(keys, targets)


def device_pool(mem_layout: str, num_pages: int = 4) -> HostKVPool:
    """A pool in a non-canonical native order (FlashAttention, HND)."""
    layers = make_kv_layers("LBHNC", num_layers=2, num_blocks=4, heads=2, tokens=8, content=16)
    layouts = [describe_kv_tensor(t, num_blocks=4, block_size=8, num_kv_heads=2, head_size=8,
                                  is_mla=False, backend_name="FLASH_ATTN") for t in layers]
    return HostKVPool.for_layouts(num_pages, layouts, mem_layout, pin_memory=False)


@pytest.fixture
def make_store():
    names = []

    def make(backend_cls=MemBackend, mem_layout="page_first_direct", num_pages=4, ns=NS):
        pool = device_pool(mem_layout, num_pages)
        name = f"canary-{uuid.uuid4().hex}"
        names.append(name)
        ctx = StorageContext("worker", 0, 1, HEADER_BYTES + pool.bytes_per_page)
        ns = dataclasses.replace(ns, mem_layout=mem_layout)
        return PageStore(backend_cls({"store": name}, ctx), pool, ns)

    yield make
    for name in names:
        STORES.pop(name, None)


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("num_pages", [1, 4])
def test_canary_passes_on_a_sound_backend(make_store, mem_layout, num_pages, caplog):
    pages = make_store(mem_layout=mem_layout, num_pages=num_pages)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert guard_with_canary(pages) is pages
    assert "canary passed" in caplog.text
    # One object, under the reserved hash, holding the pattern (header + page).
    [(key, blob)] = pages.backend.data.items()
    assert key == pages.keys([canary_hash(pages.ns)])[0] and is_canary_key(key)
    assert len(blob) == HEADER_BYTES + pages.pool.bytes_per_page
    # The pattern, in the layout's byte order (canonical for layer_first).
    pattern = canary_pattern(pages.ns, pages.pool.bytes_per_page)
    assert sorted(blob[HEADER_BYTES:]) == sorted(pattern)
    if mem_layout == "layer_first":
        assert blob[HEADER_BYTES:] == pattern
    # The scratch pages are zero again: nothing leaks into the pool.
    assert not torch.any(pages.pool.buffer)


def test_canary_hash_is_reserved_and_per_rank():
    h = canary_hash(NS)
    assert len(h) == 32 and h.startswith(CANARY_MARK)
    assert canary_hash(NS) == h
    assert canary_hash(NS.for_rank(0, pp_rank=0)) == h
    mla = KeyNamespace("m", "bfloat16", "layer_first", 8, 2, 0, is_mla=True)
    # MLA ranks share a tag but each writes its own canary.
    assert mla.tag == mla.for_rank(1).tag
    assert canary_hash(mla) != canary_hash(mla.for_rank(1))
    assert not is_canary_key(NS.object_keys([b"\x00" * 32])[0])


def test_altered_bytes_disable_l3_for_this_worker(make_store, caplog):
    pages = make_store(FlippingBackend)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        guarded = guard_with_canary(pages)
    assert isinstance(guarded, DisabledPageStore)
    assert "'flipping'" in caplog.text and pages.ns.tag in caplog.text
    assert "header or checksum mismatch" in caplog.text
    assert not torch.any(pages.pool.buffer)
    # Disabled: reads are misses, writes are skipped, nothing else changes.
    before = dict(pages.backend.data)
    assert guarded.write([b"a" * 32], [1]) == [False]
    assert guarded.read([canary_hash(pages.ns)], [1]) == 0
    assert guarded.exists_prefix([canary_hash(pages.ns)]) == 0
    assert pages.backend.data == before
    assert guarded.backend is pages.backend and guarded.pool is pages.pool


def test_object_that_verifies_with_other_bytes_disables_l3(make_store, caplog):
    pages = make_store(ReorderingBackend)
    assert run_canary(pages).outcome == FAILED
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        guarded = guard_with_canary(pages)
    assert isinstance(guarded, DisabledPageStore)
    assert "verified but holds other bytes" in guarded.reason
    assert "'reordering'" in caplog.text and pages.ns.tag in caplog.text


@pytest.mark.parametrize("backend_cls, detail", [
    (RefusingBackend, "write refused"),
    (RaisingBackend, "store down"),
    (ForgetfulBackend, "not found"),
])
def test_an_outage_is_a_warning_not_a_failure(make_store, backend_cls, detail, caplog):
    pages = make_store(backend_cls)
    assert run_canary(pages).outcome == UNAVAILABLE
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert guard_with_canary(pages) is pages
    assert detail in caplog.text and "L3 stays on" in caplog.text
    assert not torch.any(pages.pool.buffer)


def test_one_failed_read_is_retried(make_store):
    pages = make_store(MissingFirstGetsBackend)
    assert guard_with_canary(pages) is pages
    assert pages.backend.misses == 0


def test_failing_reads_of_an_intact_object_are_not_a_failure(make_store, caplog):
    """A flaky store that keeps failing page reads while the object is
    intact costs misses, never wrong KV: L3 stays on."""
    pages = make_store(MissingFirstGetsBackend)
    pages.backend.misses = 2
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert guard_with_canary(pages) is pages
    assert "intact, but page reads fail" in caplog.text


def test_disabled_worker_still_completes_the_schedulers_ops(make_store):
    pages = make_store(FlippingBackend)
    io = StorageIO(guard_with_canary(pages), worker_id=0, writes=True)
    try:
        io.submit_backup(BackupJob(1, (b"b" * 32,), (1,)))
        io.submit_prefetch(PrefetchJob(2, (b"b" * 32,), (2,)))
        assert io.wait_idle(10)
        progress, backups = io.poll()
        assert backups == {1}  # acknowledged: its pages are unpinned
        assert progress == {2: PrefetchProgress(0, True)}  # a finished miss
        # The canary only: the backup was skipped.
        assert [is_canary_key(k) for k in pages.backend.data] == [True]
    finally:
        io.shutdown()


def test_build_storage_io_runs_the_canary(tmp_path):
    store = f"canary-{uuid.uuid4().hex}"
    from tests.conftest import make_config

    cfg = make_config(
        hicache_mem_layout="layer_first", hicache_io_backend="direct",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": store,
        },
    )
    geom = KVGeometry(block_size=8, layer_names=("l0", "l1"), bytes_per_block=0,
                      num_l1_blocks=4, num_kv_heads=2, head_size=8, is_mla=False,
                      kv_dtype="bfloat16")
    from vllm.config import CacheConfig

    vllm_config = SimpleNamespace(
        cache_config=CacheConfig(block_size=8),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="org/model", revision=None),
    )
    io = build_storage_io(cfg, geom, vllm_config, device_pool("layer_first"))
    try:
        assert isinstance(io.pages, PageStore)
        [key] = STORES[store]
        assert is_canary_key(key) and key.startswith(io.pages.ns.tag)
        assert io.pages.ns.page_format.startswith("2B[layer2:")
    finally:
        io.shutdown()
        STORES.pop(store, None)


# --- head slices (tp_lcm_size) ---------------------------------------------------


def test_canary_of_head_slices_round_trips_and_catches_a_reordering_store(make_store):
    """A page of two slices: both objects are written and checked."""
    sliced = dataclasses.replace(NS, head_slices=2)
    pages = make_store(ns=sliced)
    assert run_canary(pages).outcome == "passed"
    assert len(STORES[pages.backend.store_name]) == 2  # one object per slice
    result = run_canary(make_store(ReorderingBackend, ns=sliced))
    assert result.outcome == FAILED


def test_canary_keys_of_sliced_instances_of_other_tp_sizes_differ():
    """TP=1 and TP=2 rank 0 share slice 0's tag but write other bytes under
    it: their canaries must not overwrite each other's."""
    tp1 = dataclasses.replace(NS, head_slices=2)
    tp2 = dataclasses.replace(NS, tp_size=2, head_slices=2)
    assert tp1.tag == tp2.tag
    assert canary_hash(tp1) != canary_hash(tp2)
    # Without slices the key is unchanged (the tag already names the TP size).
    assert canary_hash(NS) == canary_hash(dataclasses.replace(NS, head_slices=0))
