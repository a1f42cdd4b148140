import logging
import os
import uuid
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_config
from tests.connector import mem_backend
from tests.kernels.kv_factory import make_kv_layers
from vllm_hicache.connector.geometry import KVGeometry
from vllm_hicache.host import HostKVPool
from vllm_hicache.kernels import describe_kv_tensor
from vllm_hicache.l3.canary import DisabledPageStore
from vllm_hicache.l3.identity import (
    expected_page_format,
    pool_page_format,
    weights_fingerprint,
)
from vllm_hicache.l3.setup import (
    build_planner,
    check_shareable_hashes,
    checked_page_store,
    namespace,
)
from vllm_hicache.storage import StorageContext
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 2, 4, 2, 8, 8
LOGGER = "vllm_hicache.l3.setup"
IDENTITY_LOGGER = "vllm_hicache.l3.identity"


def fake_config(algo="sha256", pp=1, tp=1, model="org/model", revision=None,
                kv_cache_layout=None, backend=None, total_kv_heads=HEADS,
                total_layers=LAYERS):
    from vllm.config import CacheConfig

    cache = CacheConfig(block_size=BLOCK)
    cache.prefix_caching_hash_algo = algo
    cache.kv_cache_layout = kv_cache_layout
    return SimpleNamespace(
        cache_config=cache,
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        model_config=SimpleNamespace(
            model=str(model), revision=revision,
            get_total_num_kv_heads=lambda: total_kv_heads,
            get_total_num_hidden_layers=lambda: total_layers),
        attention_config=SimpleNamespace(
            backend=None if backend is None else SimpleNamespace(name=backend)),
    )


def geometry(is_mla=False, dtype="bfloat16") -> KVGeometry:
    heads, head = (1, 2 * HEAD) if is_mla else (HEADS, HEAD)
    return KVGeometry(
        block_size=BLOCK, layer_names=tuple(f"l{i}" for i in range(LAYERS)),
        bytes_per_block=0, num_l1_blocks=BLOCKS, num_kv_heads=heads, head_size=head,
        is_mla=is_mla, kv_dtype=dtype,
    )


def device_pool(order: str, mem_layout: str, backend="FLASH_ATTN", is_mla=False,
                kernel_blocks=1) -> HostKVPool:
    """A host pool for L1 tensors in vLLM layout ``order`` (the worker's view)."""
    geom = geometry(is_mla)
    content = geom.head_size if is_mla else 2 * geom.head_size
    layers = make_kv_layers(order, num_layers=LAYERS, num_blocks=BLOCKS * kernel_blocks,
                            heads=1 if is_mla else HEADS, tokens=BLOCK // kernel_blocks,
                            content=content)
    layouts = [
        describe_kv_tensor(t, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=geom.num_kv_heads,
                           head_size=geom.head_size, is_mla=is_mla, backend_name=backend)
        for t in layers
    ]
    return HostKVPool.for_layouts(3, layouts, mem_layout, pin_memory=False)


def model_dir(path, weights: bytes = b"\x01" * 1000):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"hidden_size": 128}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    return path


# --- shareable hashes -----------------------------------------------------------


def test_sha256_is_shareable():
    check_shareable_hashes(fake_config("sha256"))
    check_shareable_hashes(fake_config("sha256_cbor"))


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_random_seeded_hash_needs_pythonhashseed(monkeypatch, algo):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        check_shareable_hashes(fake_config(algo))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_shareable_hashes(fake_config(algo))


def test_pipeline_parallel_is_accepted():
    check_shareable_hashes(fake_config(pp=2))


# --- namespaces from a vLLM config ------------------------------------------------


def test_namespace_from_vllm_config_names_byte_order_and_weights(tiny_model_dir):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"),
    )
    ns = namespace(make_config(), geometry(dtype="float32"), vllm_config, 0)
    assert ns.mem_layout == "layer_first"
    # layer_first is staged in canonical order: 4-byte elements, layer-major.
    assert ns.page_format == "4B[layer2:256 plane2:128 token8:16 head2:8 elem8:1]"
    assert ns.weights_fingerprint == weights_fingerprint(str(tiny_model_dir))[0]
    assert len(ns.weights_fingerprint) == 32
    assert (ns.tp_size, ns.pp_size, ns.pp_rank, ns.model_version) == (1, 1, 0, "")
    assert ns.model == str(tiny_model_dir)


def test_rewritten_weights_get_a_new_tag(tmp_path):
    path = model_dir(tmp_path / "m")
    cfg, geom = make_config(), geometry()
    before = namespace(cfg, geom, fake_config(model=path), 0)
    assert before == namespace(cfg, geom, fake_config(model=path), 0)
    (path / "model.safetensors").write_bytes(b"\x02" * 1000)  # same size, new weights
    after = namespace(cfg, geom, fake_config(model=path), 0)
    assert after.tag != before.tag
    (path / "config.json").write_text('{"hidden_size": 256}')
    assert namespace(cfg, geom, fake_config(model=path), 0).tag != after.tag


def test_large_weight_file_is_sampled_and_copies_agree(tmp_path):
    weights = os.urandom(1 << 20)
    a = model_dir(tmp_path / "a", weights)
    b = model_dir(tmp_path / "b", weights)
    os.utime(b / "model.safetensors", (1, 1))  # another copy, another mtime
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(b))
    # Files that do not decide the KV do not count.
    (b / "tokenizer.json").write_text('{"other": 1}')
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(b))
    (b / "model.safetensors").write_bytes(os.urandom(1 << 20))  # a new fine-tune
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))
    edited = bytearray(weights)
    edited[100:108] = b"\xff" * 8  # e.g. the safetensors header
    (b / "model.safetensors").write_bytes(bytes(edited))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))
    (b / "extra.bin").write_bytes(b"x")
    assert weights_fingerprint(str(b))[1] == 2  # weight files (config.json: hashed too)


def test_hf_cache_snapshot_uses_blob_names(tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name, blob in (("config.json", "c1"), ("model.safetensors", "sha-one")):
        (blobs / blob).write_bytes(b"same bytes")
        (snap / name).symlink_to(blobs / blob)
    first = weights_fingerprint(str(snap))
    (snap / "model.safetensors").unlink()
    (blobs / "sha-two").write_bytes(b"same bytes")
    (snap / "model.safetensors").symlink_to(blobs / "sha-two")
    assert weights_fingerprint(str(snap)) != first


def test_model_version_names_the_weights(tmp_path):
    path = model_dir(tmp_path / "m")
    geom = geometry()
    v1 = namespace(make_config(model_version="sft-1"), geom, fake_config(model=path), 0)
    v2 = namespace(make_config(model_version="sft-2"), geom, fake_config(model=path), 0)
    assert (v1.model_version, v1.weights_fingerprint) == ("sft-1", "")
    assert v1.tag != v2.tag
    # Explicit: rewriting the files no longer changes the key.
    (path / "model.safetensors").write_bytes(b"\x03" * 10)
    assert namespace(make_config(model_version="sft-1"), geom, fake_config(model=path), 0) == v1


@pytest.mark.parametrize("value, match", [
    (3, "expected a string"), (" v1", "whitespace"), ("a\nb", "printable"), ("x" * 300, "256"),
])
def test_model_version_is_validated(value, match):
    with pytest.raises(ValueError, match=match) as err:
        make_config(model_version=value)
    assert "model_version" in str(err.value)


def test_hub_id_is_identified_by_name_and_revision(caplog):
    geom = geometry()
    with caplog.at_level(logging.INFO, logger=IDENTITY_LOGGER):
        ns = namespace(make_config(), geom, fake_config(model="org/not-a-dir"), 0, log=True)
    assert ns.weights_fingerprint == "" and ns.model == "org/not-a-dir"
    assert "name and revision only" in caplog.text and "model_version" in caplog.text
    pinned = namespace(make_config(), geom, fake_config(model="org/not-a-dir", revision="abc"), 0)
    assert pinned.model == "org/not-a-dir@abc"
    assert pinned.tag != ns.tag


def test_directory_without_weight_files_warns(tmp_path, caplog):
    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger=IDENTITY_LOGGER):
        namespace(make_config(), geometry(), fake_config(model=tmp_path), 0, log=True)
    assert "name and revision only" in caplog.text


def test_namespaces_cover_every_pp_and_tp_rank(tmp_path):
    store = uuid.uuid4().hex
    cfg = make_config(
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": store,
        },
    )
    vllm_config = fake_config(model=model_dir(tmp_path / "m"), pp=2, tp=2)
    planner = build_planner(cfg, geometry(), vllm_config, num_pages=64)
    try:
        shards = {(ns.pp_rank, ns.tp_rank) for ns in planner.namespaces}
        assert shards == {(0, 0), (0, 1), (1, 0), (1, 1)}
        assert all(ns.pp_size == 2 for ns in planner.namespaces)
        assert len({ns.tag for ns in planner.namespaces}) == 4
        # A worker derives the same namespace for its own ranks.
        worker_ns = namespace(cfg, geometry(), vllm_config, 1, 1)
        assert worker_ns in planner.namespaces
    finally:
        planner.close()
        mem_backend.STORES.pop(store, None)


# --- page format: what decides the payload's byte order -----------------------------


def test_pd_like_second_layout_gets_another_namespace():
    """Two instances whose device tensors differ only in block order (NHD vs
    HND): page_first_direct stores that order, so their keys differ; the
    canonical layouts store the same bytes, so their keys agree."""
    cfg, geom, vllm_config = make_config(), geometry(), fake_config()
    for mem_layout, same in (("page_first_direct", False), ("layer_first", True),
                             ("page_first", True)):
        nhd = device_pool("LBNHC", mem_layout)
        hnd = device_pool("LBHNC", mem_layout)
        formats = pool_page_format(nhd), pool_page_format(hnd)
        spaces = [namespace(cfg, geom, vllm_config, 0, page_format=f) for f in formats]
        assert (formats[0] == formats[1]) is same, (mem_layout, formats)
        assert (spaces[0].tag == spaces[1].tag) is same


def test_cpu_and_gpu_backends_store_different_orders():
    cpu = device_pool("LBHNC", "page_first_direct", backend="CPU_ATTN")
    gpu = device_pool("LBHNC", "page_first_direct", backend="FLASH_ATTN")
    assert pool_page_format(cpu) != pool_page_format(gpu)
    assert pool_page_format(cpu) == "2B[layer2:256 head2:128 plane2:64 token8:8 elem8:1]"
    assert pool_page_format(gpu) == "2B[layer2:256 head2:128 token8:16 plane2:8 elem8:1]"


def test_block_outer_layouts_with_the_same_block_order_share():
    # A block's bytes are the same whether layers or blocks are outermost.
    formats = {pool_page_format(device_pool(o, "page_first_direct"))
               for o in ("LBHNC", "LHBNC", "BLHNC", "BHLNC")}
    assert len(formats) == 1


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first", "page_first_direct"])
def test_scheduler_derives_the_workers_page_format(order, mem_layout):
    pool = device_pool(order, mem_layout)
    vllm_config = fake_config(kv_cache_layout=order, backend="FLASH_ATTN")
    cfg = make_config(hicache_mem_layout=mem_layout)
    assert cfg.hicache_mem_layout == mem_layout
    assert expected_page_format(cfg, geometry(), vllm_config) == pool_page_format(pool)


def test_scheduler_derives_cpu_and_mla_orders(monkeypatch):
    from vllm.platforms import current_platform

    cfg = make_config(hicache_mem_layout="page_first_direct", hicache_io_backend="direct")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    cpu = device_pool("LBHNC", "page_first_direct", backend="CPU_ATTN")
    assert expected_page_format(cfg, geometry(), fake_config()) == pool_page_format(cpu)
    mla = device_pool("LBHNC", "page_first_direct", is_mla=True)
    assert expected_page_format(cfg, geometry(is_mla=True), fake_config()) == pool_page_format(mla)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert expected_page_format(cfg, geometry(), fake_config()) != pool_page_format(cpu)


def page_store(pool: HostKVPool, cfg, vllm_config) -> PageStore:
    ctx = StorageContext("worker", 0, 1, HEADER_BYTES + pool.bytes_per_page)
    backend = mem_backend.MemBackend({"store": uuid.uuid4().hex}, ctx)
    ns = namespace(cfg, geometry(), vllm_config, 0, page_format=pool_page_format(pool))
    return PageStore(backend, pool, ns)


def test_worker_whose_order_the_scheduler_cannot_derive_keeps_l3_off(caplog):
    """vLLM split each block into 2 kernel blocks: the device order differs
    from what the scheduler derives, so this worker's keys would never be
    looked up. It refuses L3 (reads miss, writes skipped) with an error."""
    cfg = make_config(hicache_mem_layout="page_first_direct", hicache_io_backend="direct")
    vllm_config = fake_config(kv_cache_layout="LBHNC", backend="FLASH_ATTN")
    pool = device_pool("LBHNC", "page_first_direct", kernel_blocks=2)
    pages = page_store(pool, cfg, vllm_config)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        checked = checked_page_store(pages, expected_page_format(cfg, geometry(), vllm_config))
    assert isinstance(checked, DisabledPageStore)
    assert "kblock2" in pages.ns.page_format
    assert pages.ns.tag in caplog.text and "layer_first (or page_first)" in caplog.text
    assert pages.backend.data == {}  # no canary either: nothing written
    assert checked.write([b"h"], [0]) == [False] and checked.read([b"h"], [0]) == 0
    assert checked.exists_prefix([b"h"]) == 0


def test_worker_with_the_expected_order_runs_the_canary():
    cfg = make_config(hicache_mem_layout="page_first_direct", hicache_io_backend="direct")
    vllm_config = fake_config(kv_cache_layout="LBNHC", backend="FLASH_ATTN")
    pages = page_store(device_pool("LBNHC", "page_first_direct"), cfg, vllm_config)
    checked = checked_page_store(pages, expected_page_format(cfg, geometry(), vllm_config))
    assert checked is pages
    assert len(pages.backend.data) == 1  # the canary object
    assert not torch.any(pages.pool.buffer)


# --- heterogeneous TP (tp_lcm_size) and pipeline stages ------------------------------


def sliced_config(mem_layout="layer_first", lcm=2, **extra):
    store = uuid.uuid4().hex
    io_backend = "kernel" if mem_layout == "page_first" else "direct"
    return make_config(
        hicache_mem_layout=mem_layout, hicache_io_backend=io_backend,
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": store, "tp_lcm_size": lcm, **extra,
        },
    )


def rank_geometry(tp: int, is_mla: bool = False) -> KVGeometry:
    import dataclasses

    return dataclasses.replace(geometry(is_mla), num_kv_heads=1 if is_mla else HEADS // tp)


def rank_device_pool(tp: int, order: str, mem_layout: str, backend: str) -> HostKVPool:
    heads = HEADS // tp
    layers = make_kv_layers(order, num_layers=LAYERS, num_blocks=BLOCKS, heads=heads,
                            tokens=BLOCK, content=2 * HEAD)
    layouts = [describe_kv_tensor(t, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=heads,
                                  head_size=HEAD, is_mla=False, backend_name=backend)
               for t in layers]
    return HostKVPool.for_layouts(3, layouts, mem_layout, pin_memory=False)


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("order, backend", [("LBHNC", "CPU_ATTN"), ("LBNHC", "FLASH_ATTN"),
                                            ("LBHNC", "FLASH_ATTN")])
def test_tp1_and_tp2_derive_the_same_slice_keys(tmp_path, mem_layout, order, backend):
    """With tp_lcm_size the scheduler of a TP=1 and of a TP=2 instance look
    up the same keys, and each worker's actual slice format is the one its
    scheduler derives."""
    cfg = sliced_config(mem_layout)
    model = model_dir(tmp_path / "m")
    tags = {}
    for tp in (1, 2):
        vllm_config = fake_config(model=model, tp=tp, kv_cache_layout=order, backend=backend)
        planner = build_planner(cfg, rank_geometry(tp), vllm_config, num_pages=64)
        try:
            tags[tp] = [ns.tag for ns in planner.namespaces]
            assert planner.world_size == tp
        finally:
            planner.close()
        for rank in range(tp):
            ns = namespace(cfg, rank_geometry(tp), vllm_config, rank)
            pool = rank_device_pool(tp, order, cfg.hicache_mem_layout, backend)
            actual = pool_page_format(pool, slice_heads=1)
            assert actual == ns.page_format, (tp, rank)
    assert tags[1] == tags[2] and len(tags[1]) == 2
    assert [t[-2:] for t in tags[1]] == ["s0", "s1"]
    # Without tp_lcm_size the two instances share nothing.
    plain = make_config(hicache_mem_layout=mem_layout)
    assert (namespace(plain, rank_geometry(1), fake_config(model=model, tp=1), 0).tag
            != namespace(plain, rank_geometry(2), fake_config(model=model, tp=2), 0).tag)


@pytest.mark.parametrize("lcm, tp, is_mla, match", [
    (3, 2, False, "not a multiple of this instance's tensor_parallel_size=2"),
    (4, 1, False, "2 KV heads cannot be cut into 4"),
    (2, 2, True, "does not apply to MLA"),
])
def test_unusable_tp_lcm_size_is_refused_at_start(tmp_path, lcm, tp, is_mla, match):
    cfg = sliced_config(lcm=lcm)
    with pytest.raises(ValueError, match=match):
        build_planner(cfg, rank_geometry(tp, is_mla), fake_config(tp=tp), num_pages=64)


def test_tp_lcm_size_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="tp_lcm_size"):
        sliced_config(lcm=-2)
    with pytest.raises(ValueError, match="tp_lcm_size"):
        sliced_config(lcm="2")
    assert sliced_config(lcm=0).storage.tp_lcm_size == 0


def test_each_pipeline_stage_has_its_own_layers_in_its_page_format(tmp_path):
    """3 layers over 2 stages (2 + 1): the scheduler, which holds the first
    stage's geometry, derives the second stage's format from its layer count,
    which is what that stage's worker has."""
    import dataclasses

    cfg = make_config(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config={
        "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
        "store": uuid.uuid4().hex})
    vllm_config = fake_config(model=model_dir(tmp_path / "m"), pp=2, total_layers=3)
    stage0 = dataclasses.replace(geometry(), layer_names=("l0", "l1"))
    stage1 = dataclasses.replace(geometry(), layer_names=("l2",))
    planner = build_planner(cfg, stage0, vllm_config, num_pages=64)
    try:
        formats = {ns.pp_rank: ns.page_format for ns in planner.namespaces}
        assert "layer2" in formats[0] and "layer" not in formats[1]
        assert planner.world_size == 2  # both stages ack
        for pp_rank, geom in ((0, stage0), (1, stage1)):
            assert namespace(cfg, geom, vllm_config, 0, pp_rank) in planner.namespaces
    finally:
        planner.close()


def test_worker_reports_are_told_apart_across_stages(monkeypatch):
    """Progress and acks are counted per worker id: two stages' TP rank 0
    must not count as one worker, or a prefetch would commit with one
    stage's layers missing."""
    from vllm.distributed import parallel_state

    from vllm_hicache.l3.setup import num_workers, worker_id

    vllm_config = fake_config(pp=2, tp=2)
    ids = set()
    for pp_rank in range(2):
        for tp_rank in range(2):
            monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank",
                                lambda r=tp_rank: r)
            monkeypatch.setattr(parallel_state, "get_pp_group",
                                lambda p=pp_rank: SimpleNamespace(rank_in_group=p))
            ids.add(worker_id(vllm_config))
    assert ids == set(range(num_workers(vllm_config))) == {0, 1, 2, 3}
