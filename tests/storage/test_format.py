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
