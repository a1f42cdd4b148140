import numpy as np
import pytest

from vllm_hicache.storage.format import HEADER_BYTES, encode_header, header_matches


@pytest.fixture
def payload():
    return np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)


def test_round_trip(payload):
    header = encode_header("k1", payload)
    assert header.nbytes == HEADER_BYTES
    assert header_matches(header, "k1", payload)


def test_other_key_is_a_miss(payload):
    assert not header_matches(encode_header("k1", payload), "k2", payload)


def test_flipped_payload_byte_is_a_miss(payload):
    header = encode_header("k1", payload)
    payload[100] ^= 1
    assert not header_matches(header, "k1", payload)


@pytest.mark.parametrize("offset", [0, 5, 9, 20, 30, 45])
def test_flipped_header_byte_is_a_miss(payload, offset):
    header = encode_header("k1", payload)
    header[offset] ^= 0x40
    assert not header_matches(header, "k1", payload)


def test_truncated_payload_is_a_miss(payload):
    header = encode_header("k1", payload)
    assert not header_matches(header, "k1", payload[:-1])


def test_short_header_is_a_miss(payload):
    assert not header_matches(encode_header("k1", payload)[:32], "k1", payload)


def test_layout_of_format_2(payload):
    """The fields' offsets (docs/design.md, storage/format.py)."""
    header = encode_header("k1", payload)
    raw = header.tobytes()
    assert raw[:4] == b"HCKV"
    assert int.from_bytes(raw[4:6], "little") == 2
    assert int.from_bytes(raw[6:8], "little") == HEADER_BYTES
    assert int.from_bytes(raw[8:16], "little") == payload.nbytes
    assert raw[32] == 0 and raw[33:48] == bytes(15)  # checksum only: no nonce


@pytest.mark.parametrize("field, value", [(4, 1), (32, 1), (40, 7)])
def test_unexpected_version_protection_or_nonce_is_a_miss(payload, field, value):
    """Even with the checksum recomputed over the changed fields."""
    from vllm_hicache.storage.format import FIELD_BYTES, checksum

    header = encode_header("k1", payload)
    header[field] = value
    header[FIELD_BYTES:] = np.frombuffer(checksum(header[:FIELD_BYTES].tobytes(), payload),
                                         np.uint8)
    assert not header_matches(header, "k1", payload)
