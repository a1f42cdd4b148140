"""On-store format of an L3 object: a 64-byte header, then the payload.

    offset  size  field
    0       4     magic b"HCKV"
    4       2     format version (1), little-endian
    6       2     header size (64)
    8       8     payload length in bytes
    16      8     xxh3-64 of the payload
    24      16    blake2b-128 of the object key (the key names namespace + block)
    40      8     xxh3-64 of bytes 0..40 (the header protects itself)
    48      16    reserved, zero

A read is accepted only if every field matches what the reader expects: its
own key, its own payload length, and the payload's checksum. Anything else —
a flipped byte, a truncated object, an object written under another key or by
another model, an unknown version — is a miss, and vLLM recomputes.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import xxhash

MAGIC = b"HCKV"
VERSION = 1
HEADER_BYTES = 64
_HEAD = struct.Struct("<4sHHQQ16s")  # 40 bytes
_SELF = struct.Struct("<Q")


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def payload_checksum(payload: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(payload))


def encode_header(key: str, payload: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The header for ``payload`` stored under ``key`` (into ``out`` if given)."""
    header = out if out is not None else np.empty(HEADER_BYTES, np.uint8)
    assert header.nbytes == HEADER_BYTES, header.nbytes
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, payload.nbytes,
                      payload_checksum(payload), key_digest(key))
    raw = head + _SELF.pack(xxhash.xxh3_64_intdigest(head)) + bytes(16)
    header[:] = np.frombuffer(raw, np.uint8)
    return header


def header_matches(header: np.ndarray, key: str, payload: np.ndarray) -> bool:
    """True iff ``header`` + ``payload`` is a valid object for ``key``."""
    if header.nbytes != HEADER_BYTES:
        return False
    raw = header.tobytes()
    head = raw[: _HEAD.size]
    if _SELF.unpack_from(raw, _HEAD.size)[0] != xxhash.xxh3_64_intdigest(head):
        return False
    magic, version, size, length, checksum, digest = _HEAD.unpack(head)
    return (
        magic == MAGIC and version == VERSION and size == HEADER_BYTES
        and length == payload.nbytes and digest == key_digest(key)
        and checksum == payload_checksum(payload)
    )
