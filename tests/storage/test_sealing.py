"""Object codecs (storage/sealing.py): with a storage secret an object is
accepted only if it was sealed with that secret, for that key; encrypted
objects give a reader without the secret nothing usable."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_hicache.storage import format as fmt
from vllm_hicache.storage.sealing import (
    AeadCodec,
    ChecksumCodec,
    MacCodec,
    ObjectCodec,
    make_codec,
)
from vllm_hicache.storage_secret import StorageSecret

SECRET = StorageSecret(b"s" * 32)
OTHER = StorageSecret(b"o" * 32)
PAGE = 4096


@pytest.fixture
def payload():
    return np.random.default_rng(0).integers(0, 256, PAGE, dtype=np.uint8)


def scratch_for(codec: ObjectCodec) -> np.ndarray | None:
    size = codec.scratch_bytes(PAGE)
    return np.zeros(size, np.uint8) if size else None


def seal(codec: ObjectCodec, key: str, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The object's header and body as they would be stored (copies)."""
    header = np.empty(fmt.HEADER_BYTES, np.uint8)
    body = codec.seal(key, payload, header, scratch_for(codec))
    return header, body.copy()


def opens(codec: ObjectCodec, key: str, header: np.ndarray, body: np.ndarray,
          expected: np.ndarray | None = None) -> bool:
    """Read (header, body) as a reader with ``codec`` would; True if it opened
    (and, given ``expected``, produced exactly those bytes)."""
    scratch = scratch_for(codec)
    page = np.zeros(PAGE, np.uint8)
    target = codec.body(page, scratch)
    if target.nbytes != body.nbytes:
        return False
    target[:] = body
    ok = codec.open(key, header.copy(), target, page, scratch)
    if ok and expected is not None:
        assert np.array_equal(page, expected)
    return ok


CODECS = {
    "checksum": lambda: ChecksumCodec(),
    "gmac": lambda: MacCodec(SECRET),
    "aead": lambda: AeadCodec(SECRET),
}


@pytest.mark.parametrize("name", CODECS)
def test_round_trip(name, payload):
    codec = CODECS[name]()
    header, body = seal(codec, "k1", payload)
    assert opens(codec, "k1", header, body, expected=payload)
    assert header[32] == codec.protection


@pytest.mark.parametrize("name", CODECS)
def test_any_flipped_byte_is_a_miss(name, payload):
    codec = CODECS[name]()
    header, body = seal(codec, "k1", payload)
    for offset in range(fmt.HEADER_BYTES):
        bad = header.copy()
        bad[offset] ^= 0x01
        assert not opens(codec, "k1", bad, body), offset
    for offset in (0, 1, PAGE // 2, PAGE - 1):
        bad = body.copy()
        bad[offset] ^= 0x80
        assert not opens(codec, "k1", header, bad), offset


@pytest.mark.parametrize("name", CODECS)
def test_object_moved_to_another_key_is_a_miss(name, payload):
    codec = CODECS[name]()
    header, body = seal(codec, "k1", payload)
    assert not opens(codec, "k2", header, body)


@pytest.mark.parametrize("reader", ["gmac", "aead"])
@pytest.mark.parametrize("forger", ["checksum", "gmac-other", "aead-other", "gmac", "aead"])
def test_forged_objects_are_misses(reader, forger, payload):
    """Scenario: someone who can write the store but lacks our secret plants
    an object with valid checksums (or sealed with their own secret) under
    our key. A reader with the secret must refuse it; only an object sealed
    with the same secret and mode opens."""
    forgers = {
        "checksum": ChecksumCodec(), "gmac-other": MacCodec(OTHER), "aead-other": AeadCodec(OTHER),
        "gmac": MacCodec(SECRET), "aead": AeadCodec(SECRET),
    }
    header, body = seal(forgers[forger], "k1", payload)
    assert fmt.header_matches(header, "k1", body) == (forger == "checksum")
    assert opens(CODECS[reader](), "k1", header, body) == (forger == reader)


def test_gmac_leaves_the_payload_readable_and_binds_the_nonce(payload):
    """The MAC stores the page as it is; changing the stored nonce (or
    zeroing it) breaks the tag."""
    codec = MacCodec(SECRET)
    header, body = seal(codec, "k1", payload)
    assert np.array_equal(body, payload) and header[36:48].any()
    for nonce in (bytes(12), bytes(11) + b"\x01"):
        bad = header.copy()
        bad[36:48] = np.frombuffer(nonce, np.uint8)
        assert not opens(codec, "k1", bad, body)


def test_a_downgraded_object_is_a_miss(payload):
    """Rewriting the protection byte (and recomputing the plain checksum)
    cannot turn a forged object into one a MAC reader accepts."""
    header, body = seal(ChecksumCodec(), "k1", payload)
    header[32] = fmt.MAC
    assert not opens(MacCodec(SECRET), "k1", header, body)


def test_reader_without_the_secret_gets_nothing_usable(payload):
    header, body = seal(AeadCodec(SECRET), "k1", payload)
    # The stored bytes are not the page, nor any long run of it.
    assert not np.array_equal(body, payload)
    assert payload[:32].tobytes() not in body.tobytes() + header.tobytes()
    assert np.mean(body == payload) < 0.02  # ~1/256 by chance
    for reader in (ChecksumCodec(), MacCodec(SECRET), MacCodec(OTHER), AeadCodec(OTHER)):
        assert not opens(reader, "k1", header, body)


@pytest.mark.parametrize("codec", [AeadCodec(SECRET), MacCodec(SECRET)], ids=["aead", "gmac"])
def test_nonces_never_repeat(codec, payload):
    headers = [seal(codec, "k1", payload)[0] for _ in range(200)]
    nonces = {h[36:48].tobytes() for h in headers}
    assert len(nonces) == 200
    codec = AeadCodec(SECRET)
    # Same page, same key, fresh nonce: a different ciphertext each time.
    assert not np.array_equal(seal(codec, "k1", payload)[1], seal(codec, "k1", payload)[1])


def test_format_1_objects_are_misses(payload):
    """An object of the previous format (version 1) is never accepted."""
    header, body = seal(ChecksumCodec(), "k1", payload)
    header[4] = 1
    for codec in CODECS.values():
        assert not opens(codec(), "k1", header, body)


def test_make_codec():
    assert isinstance(make_codec(None), ChecksumCodec)
    assert isinstance(make_codec(SECRET), MacCodec)
    assert isinstance(make_codec(SECRET, encrypt=True), AeadCodec)
    with pytest.raises(ValueError, match="storage_secret"):
        make_codec(None, encrypt=True)


def test_keys_are_derived_not_the_secret():
    secret = StorageSecret(b"k" * 32)
    keys = {secret.derive("gmac"), secret.derive("aead"), secret.derive("namespace", 8)}
    assert len(keys) == 3 and b"k" * 32 not in keys
    assert secret.namespace_tag == StorageSecret(b"k" * 32).namespace_tag
    assert secret.namespace_tag != OTHER.namespace_tag
    assert len(secret.namespace_tag) == 16
