"""Reads delivered layer by layer (``PageStore.read_by_layer`` over the file
backend's ranged reads): each layer reaches the pool before the next is
read, the result counts only objects that passed their whole check, and a
missing, foreign, truncated or corrupt object shortens the read as a whole
read would."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import make_config
from vllm_hicache.host import HostKVPool
from vllm_hicache.host.layout import BlockOrder
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage import StorageContext, create_backend
from vllm_hicache.storage import pages as pages_module
from vllm_hicache.storage.file import io as file_io
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore, layer_groups
from vllm_hicache.storage.sealing import make_codec

NUM_PAGES, NUM_LAYERS = 8, 3
PLANES, BLOCK, HEADS, HEAD_SIZE = 2, 4, 2, 8
SECRET = "correct-horse-battery-staple-0123456789"
HASHES = [bytes([i]) * 32 for i in range(4)]
SRC, DST = [0, 1, 2, 3], [4, 5, 6, 7]
# vLLM's CPU attention block: [heads, block_size, planes * head_size], so the
# pool's native order is not the canonical [planes, block_size, heads, head_size].
CPU_ORDER = BlockOrder((PLANES, 1, BLOCK, HEADS, HEAD_SIZE),
                       (HEAD_SIZE, 0, PLANES * HEAD_SIZE, BLOCK * PLANES * HEAD_SIZE, 1))


@pytest.fixture
def make_pages(tmp_path):
    built = []

    def make(layout="layer_first", secret=None, encrypt=False, order=None):
        pool = HostKVPool(NUM_PAGES, NUM_LAYERS, PLANES, BLOCK, HEADS, HEAD_SIZE, torch.float32,
                          layout, pin_memory=False, block_order=order)
        pool.buffer.copy_(torch.randn_like(pool.buffer))
        extra = {"storage_secret": secret, "storage_encrypt": encrypt} if secret else {}
        st = make_config(hicache_storage_backend="file",
                         hicache_storage_backend_extra_config=extra).storage
        ctx = StorageContext("worker", 0, 1, HEADER_BYTES + pool.bytes_per_page)
        backend = create_backend("file", {"path": str(tmp_path / "l3")}, ctx)
        ns = KeyNamespace("test/model", "float32", layout, BLOCK, 1, 0,
                          protection=st.key_protection)
        built.append(PageStore(backend, pool, ns, make_codec(st.secret, st.encrypt)))
        return built[-1]

    yield make
    for p in built:
        p.backend.close()


def object_file(pages: PageStore, tmp_path, index: int) -> str:
    return file_io.object_path(str(tmp_path / "l3"), pages.keys(HASHES)[index])


class Layers:
    """``on_layer`` that records each call and, at each, which layers of the
    destination pages already hold their source's bytes."""

    def __init__(self, pages: PageStore) -> None:
        self.pages, self.calls, self.filled = pages, [], []

    def __call__(self, layer: int, num_pages: int) -> None:
        cells = self.pages.pool.cells()
        self.calls.append((layer, num_pages))
        self.filled.append([torch.equal(cells[SRC[:num_pages], lyr], cells[DST[:num_pages], lyr])
                            for lyr in range(NUM_LAYERS)])


def read_by_layer(pages: PageStore) -> tuple[int, Layers]:
    pool = pages.pool
    pool.write_pages(DST, torch.zeros(len(DST), *pool.canonical_page_shape))
    seen = Layers(pages)
    return pages.read_by_layer(HASHES, DST, seen), seen


@pytest.mark.parametrize("layout, order", [
    ("layer_first", None), ("layer_first", CPU_ORDER),
    ("page_first_direct", None), ("page_first_direct", CPU_ORDER),
])
@pytest.mark.parametrize("secret", [None, SECRET])
def test_layers_arrive_in_order_and_equal_the_written_pages(make_pages, layout, order, secret):
    pages = make_pages(layout, secret, order=order)
    assert pages.reads_by_layer
    assert pages.write(HASHES, SRC) == [True] * 4
    good, seen = read_by_layer(pages)
    assert good == 4 and pages.invalid_objects == 0
    assert seen.calls == [(layer, 4) for layer in range(NUM_LAYERS)]
    # At layer i's call, layers 0..i are in the pool. Staged (layer_first),
    # the later ones are not yet; read into the page (page_first_direct), the
    # rest of layer i's request group (here layers 1-2) already is.
    group_end = [1] + [NUM_LAYERS] * (NUM_LAYERS - 1)
    expected = [[lyr <= i or (layout == "page_first_direct" and lyr < group_end[i])
                 for lyr in range(NUM_LAYERS)] for i in range(NUM_LAYERS)]
    assert seen.filled == expected
    assert torch.equal(pages.pool.read_pages(SRC), pages.pool.read_pages(DST))


@pytest.mark.parametrize("layout, secret, encrypt", [
    ("page_first", None, False), ("layer_first", SECRET, True),
])
def test_stores_that_cannot_read_by_layer_say_so(make_pages, layout, secret, encrypt):
    """page_first's payload is token-major across layers; an encrypted one
    must be decrypted whole before any of it is usable."""
    assert not make_pages(layout, secret, encrypt).reads_by_layer


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_a_missing_object_ends_the_read_at_every_layer(make_pages, tmp_path, layout):
    pages = make_pages(layout)
    pages.write(HASHES, SRC)
    os.unlink(object_file(pages, tmp_path, 2))
    good, seen = read_by_layer(pages)
    assert good == 2
    assert seen.calls == [(layer, 2) for layer in range(NUM_LAYERS)]


@pytest.mark.parametrize("damage", ["foreign", "truncated"])
def test_a_foreign_or_truncated_object_fails_before_its_first_layer(make_pages, tmp_path, damage):
    """A header of another key (one object planted under another's name) or
    a file of the wrong size is known before any layer is copied."""
    pages = make_pages()
    pages.write(HASHES, SRC)
    target = object_file(pages, tmp_path, 1)
    if damage == "foreign":
        shutil.copyfile(object_file(pages, tmp_path, 0), target)
    else:
        os.truncate(target, os.path.getsize(target) - 1)
    good, seen = read_by_layer(pages)
    assert good == 1
    assert seen.calls == [(layer, 1) for layer in range(NUM_LAYERS)]
    assert pages.invalid_objects == (damage == "foreign")  # a truncated one is a miss


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_corrupt_layer_is_delivered_but_not_counted(make_pages, tmp_path, secret, layout):
    """The check covers the whole object, so a flipped byte in layer 1 is
    found only after the last layer: the layers were delivered (unverified),
    the result stops before the object. Read into the pool page itself
    (page_first_direct), the check runs over the page's bytes."""
    pages = make_pages(layout, secret=secret)
    pages.write(HASHES, SRC)
    layer_bytes = pages.payload_bytes // NUM_LAYERS
    with open(object_file(pages, tmp_path, 1), "r+b") as f:
        f.seek(HEADER_BYTES + layer_bytes + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    good, seen = read_by_layer(pages)
    assert seen.calls == [(layer, 4) for layer in range(NUM_LAYERS)]
    assert good == 1
    assert pages.invalid_objects == 1


def test_ranged_reads_of_the_file_backend(make_pages, tmp_path):
    pages = make_pages()
    pages.write(HASHES[:2], SRC[:2])
    ranged = pages.backend.open_ranged(pages.keys(HASHES), pages.object_bytes)
    try:
        assert ranged.num_opened == 2
        whole = open(object_file(pages, tmp_path, 1), "rb").read()
        buf = torch.zeros(100, dtype=torch.uint8).numpy()
        assert ranged.read(1, 64, buf)
        assert buf.tobytes() == whole[64:164]
        # Past the end: not all of it exists.
        assert not ranged.read(1, len(whole) - 50, buf)
    finally:
        ranged.close()
        ranged.close()  # idempotent
    with pytest.raises(IndexError):
        ranged.read(0, 0, buf)


@pytest.mark.parametrize("group_bytes, requests", [(None, 2), (1, NUM_LAYERS)])
def test_requests_per_object_follow_the_layer_groups(make_pages, monkeypatch, group_bytes,
                                                     requests):
    """A small hit is two requests per object (header with layer 0, then the
    rest); one whose layers exceed the group size streams layer by layer.
    Either way each layer reaches the pool only at its own call."""
    if group_bytes is not None:
        monkeypatch.setattr(pages_module, "READ_GROUP_BYTES", group_bytes)
    pages = make_pages()
    pages.write(HASHES, SRC)
    counted = []
    open_ranged = pages.backend.open_ranged

    def counting(keys, object_bytes):
        ranged = open_ranged(keys, object_bytes)
        for name in ("read", "read_vectored"):
            inner = getattr(ranged, name)
            setattr(ranged, name, lambda i, *a, _inner=inner: counted.append(i) or _inner(i, *a))
        return ranged

    monkeypatch.setattr(pages.backend, "open_ranged", counting)
    good, seen = read_by_layer(pages)
    assert good == 4
    assert sorted(counted) == sorted(list(range(4)) * requests)
    assert seen.filled == [[lyr <= i for lyr in range(NUM_LAYERS)] for i in range(NUM_LAYERS)]
    assert torch.equal(pages.pool.read_pages(SRC), pages.pool.read_pages(DST))


def test_layer_groups():
    assert layer_groups(6, 768 << 10, 8 << 20) == [(0, 1), (1, 6)]
    assert layer_groups(6, 3 << 20, 8 << 20) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert layer_groups(4, 10 << 20, 8 << 20) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_groups(1, 1, 8 << 20) == [(0, 1)]
    assert layer_groups(3, 0, 8 << 20) == [(0, 1), (1, 3)]  # nothing opened


def test_a_vectored_range_read_resumes_after_a_short_read(tmp_path, monkeypatch):
    path = tmp_path / "f"
    data = bytes(range(256)) * 4
    path.write_bytes(data)
    real = os.preadv
    calls = []

    def short_first(fd, views, offset):  # the first request gets 10 bytes only
        calls.append(offset)
        if len(calls) == 1:
            return real(fd, [memoryview(views[0])[:10]], offset)
        return real(fd, views, offset)

    monkeypatch.setattr(file_io.os, "preadv", short_first)
    head, body = np.zeros(64, np.uint8), np.zeros(900, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert file_io.read_ranges(fd, 7, [head, body])
        assert head.tobytes() + body.tobytes() == data[7:7 + 964]
        assert not file_io.read_ranges(fd, 100, [head, body])  # past the end
    finally:
        os.close(fd)
