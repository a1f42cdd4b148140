"""Pages through PageStore + the file backend with a storage secret: what a
writer without the secret can plant is a miss, what a reader without it
finds is unusable, and the secret shows up nowhere."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import make_config
from vllm_hicache.host import HostKVPool
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.storage import StorageContext, create_backend
from vllm_hicache.storage import pages as pages_module
from vllm_hicache.storage.format import HEADER_BYTES
from vllm_hicache.storage.pages import PageStore
from vllm_hicache.storage.sealing import ChecksumCodec, make_codec

NUM_PAGES = 8
SECRET = "correct-horse-battery-staple-0123456789"
OTHER_SECRET = "another-tenant-entirely-9876543210"
HASHES = [bytes([i]) * 32 for i in range(4)]


def storage(secret: str | None = None, encrypt: bool = False):
    extra = {}
    if secret is not None:
        extra["storage_secret"] = secret
    if encrypt:
        extra["storage_encrypt"] = True
    return make_config(hicache_storage_backend="file",
                       hicache_storage_backend_extra_config=extra).storage


@pytest.fixture
def make_pages(tmp_path):
    """``make_pages(secret, encrypt, layout, ns=None)``: a PageStore on one
    shared directory, with the namespace and codec the connector would build
    (l3_setup), or a forced ``ns`` (an attacker can list the store's keys)."""
    built = []

    def make(secret=None, encrypt=False, layout="page_first", ns=None, codec=None):
        pool = HostKVPool(NUM_PAGES, 2, 2, 4, 2, 8, torch.float32, layout, pin_memory=False)
        pool.buffer.copy_(torch.randn_like(pool.buffer))
        st = storage(secret, encrypt)
        ctx = StorageContext("worker", 0, 1, HEADER_BYTES + pool.bytes_per_page)
        backend = create_backend("file", {"path": str(tmp_path / "l3")}, ctx)
        if ns is None:
            ns = KeyNamespace("test/model", "float32", layout, 4, 1, 0,
                              protection=st.key_protection)
        codec = codec if codec is not None else make_codec(st.secret, st.encrypt)
        built.append(PageStore(backend, pool, ns, codec))
        return built[-1]

    yield make
    for p in built:
        p.backend.close()


def read_back(pages: PageStore, src: list[int], dst: list[int], first: int = 0) -> int:
    """Read the objects of HASHES[first:], written from pages ``src``, into
    ``dst``: the leading pages read, each checked equal to its source."""
    pool = pages.pool
    pool.write_pages(dst, torch.zeros(len(dst), *pool.canonical_page_shape, dtype=pool.dtype))
    good = pages.read(HASHES[first:first + len(src)], dst)
    assert torch.equal(pages.pool.read_pages(src[:good]), pages.pool.read_pages(dst[:good]))
    return good


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("secret, encrypt", [(None, False), (SECRET, False), (SECRET, True)])
def test_round_trip(make_pages, layout, secret, encrypt, monkeypatch):
    # Scratch for one object only: an encrypted batch is cut into calls of one.
    monkeypatch.setattr(pages_module, "SCRATCH_BYTES", 1)
    pages = make_pages(secret, encrypt, layout)
    assert pages.write(HASHES, [0, 1, 2, 3]) == [True] * 4
    assert read_back(pages, [0, 1, 2, 3], [4, 5, 6, 7]) == 4
    assert pages.invalid_objects == 0


@pytest.mark.parametrize("staging_bytes", [1 << 20, 1])
def test_staged_reads_reuse_their_staging(make_pages, monkeypatch, staging_bytes):
    """layer_first reads are staged: one thread's reads reuse its staging
    memory (a read must not see an earlier read's bytes, or scatter from the
    wrong place), and a read bigger than STAGING_BYTES stages through fresh
    memory."""
    monkeypatch.setattr(pages_module, "STAGING_BYTES", staging_bytes)
    pages = make_pages(layout="layer_first")
    assert pages.write(HASHES[:3], [0, 1, 2]) == [True] * 3
    assert read_back(pages, [0, 1, 2], [4, 5, 6]) == 3
    assert read_back(pages, [1, 2], [6, 7], first=1) == 2  # a smaller read after it
    # The fourth object is missing: the leading three are read, page 7 is untouched.
    assert read_back(pages, [0, 1, 2, 3], [4, 5, 6, 7]) == 3
    assert not pages.pool.read_pages([7]).any()


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("forger", ["no secret", "other secret"])
def test_forged_objects_are_misses(make_pages, encrypt, forger, caplog):
    """Scenario: someone who can write the store lists our keys and writes
    objects of their own under them: with valid checksums, or sealed with
    their own secret. We read none of them (a miss: vLLM recomputes), count
    them, and serve our own objects again once they are rewritten."""
    ours = make_pages(SECRET, encrypt)
    assert ours.write(HASHES, [0, 1, 2, 3]) == [True] * 4
    codec = ChecksumCodec() if forger == "no secret" else make_codec(
        storage(OTHER_SECRET).secret, encrypt)
    theirs = make_pages(ns=ours.ns, codec=codec)  # other KV, our keys
    assert theirs.write(HASHES[2:], [0, 1]) == [True, True]
    with caplog.at_level(logging.DEBUG):
        assert read_back(ours, [0, 1, 2, 3], [4, 5, 6, 7]) == 2
        assert ours.invalid_objects == 1
        assert read_back(ours, [2], [6], first=2) == 0
    assert ours.stats()["invalid_objects"] == 2
    assert "did not verify" in caplog.text and SECRET not in caplog.text
    assert ours.write(HASHES[2:], [2, 3]) == [True, True]  # a backup rewrites them
    assert read_back(ours, [0, 1, 2, 3], [4, 5, 6, 7]) == 4


def test_encrypted_objects_reveal_nothing(make_pages, tmp_path):
    ours = make_pages(SECRET, encrypt=True)
    assert ours.write(HASHES, [0, 1, 2, 3]) == [True] * 4
    blobs = [f.read_bytes() for f in sorted((tmp_path / "l3").rglob("*.hckv"))]
    assert len(blobs) == 4
    page_bytes = ours.pool.read_pages([0, 1, 2, 3]).view(torch.uint8).reshape(4, -1)
    for i in range(4):
        window = bytes(page_bytes[i, 64:96].tolist())
        assert not any(window in blob for blob in blobs)
    # Readers without the secret, or with another, even at our very keys.
    for reader in (make_pages(ns=ours.ns, codec=ChecksumCodec()),
                   make_pages(ns=ours.ns, codec=make_codec(storage(OTHER_SECRET).secret, True)),
                   make_pages(ns=ours.ns, codec=make_codec(storage(SECRET).secret, False))):
        assert read_back(reader, [0], [4]) == 0
    assert read_back(ours, [0, 1, 2, 3], [4, 5, 6, 7]) == 4


def test_secrets_and_modes_separate_namespaces(make_pages):
    """Instances never look up each other's objects: the key names the mode
    and a one-way tag of the secret (never the secret)."""
    ours = make_pages(SECRET)
    ours.write(HASHES, [0, 1, 2, 3])
    assert ours.exists_prefix(HASHES) == 4
    for other in (make_pages(), make_pages(OTHER_SECRET), make_pages(SECRET, encrypt=True)):
        assert other.ns.tag != ours.ns.tag
        assert other.exists_prefix(HASHES) == 0
        assert read_back(other, [0], [4]) == 0
    assert make_pages(SECRET).ns.tag == ours.ns.tag  # same secret, same keys
    for key in ours.keys(HASHES):
        assert SECRET not in key and SECRET.encode().hex() not in key


def test_secret_is_in_no_repr_or_log(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG):
        cfg = make_config(hicache_storage_backend="file", hicache_storage_backend_extra_config={
            "path": str(tmp_path), "storage_secret": SECRET, "storage_encrypt": True})
        st = cfg.storage
        texts = [repr(cfg), str(cfg), repr(st), repr(st.secret), str(st.secret),
                 f"{st.secret}", repr(dict(st.backend_options)), st.key_protection,
                 repr(make_codec(st.secret, True).__dict__)]
    for text in texts + [caplog.text]:
        assert SECRET not in text
    assert "storage_secret" not in st.backend_options


@pytest.mark.parametrize("encrypt", [False, True])
def test_canary_with_a_secret(make_pages, encrypt):
    """The start-up canary runs through the sealing codec, and its diagnosis
    of an object that comes back altered uses it too."""
    from vllm_hicache.l3.canary import FAILED, PASSED, run_canary

    pages = make_pages(SECRET, encrypt)
    assert run_canary(pages).outcome == PASSED
    get = pages.backend.get

    def flipping(keys, targets):
        found = get(keys, targets)
        for bufs in targets:
            bufs[-1][7] ^= 0xFF
        return found

    pages.backend.get = flipping
    result = run_canary(pages)
    assert result.outcome == FAILED
    assert f"header or {'aead' if encrypt else 'gmac'} mismatch" in result.detail
