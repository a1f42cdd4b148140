"""On-store format of an L3 object: a 64-byte header, then the payload.

    offset  size  field
    0       4     magic b"HCKV"
    4       2     format version (2), little-endian
    6       2     header size (64)
    8       8     payload length in bytes
    16      16    blake2b-128 of the object key (the key names namespace + block)
    32      1     protection: 0 checksum, 2 AEAD (encrypted payload), 3 MAC
                  (1 was a keyed-BLAKE3 MAC, no longer accepted)
    33      3     zero
    36      12    nonce (AEAD, MAC: random per object); zero otherwise
    48      16    check over bytes 0..48 and the payload:
                    checksum  xxh3-128 (catches corruption, not forgery)
                    MAC       AES-256-GMAC tag, key derived from
                              storage_secret (catches forgery too)
                    AEAD      the AES-256-GCM tag: bytes 0..48 are its
                              associated data, the payload its ciphertext

A read is accepted only if every field matches what the reader expects: its
own key, its own payload length, its own protection (a reader with a secret
refuses a checksum-only object, so a forger cannot downgrade one) and the
check. Anything else — a flipped byte, a truncated object, an object written
under another key, by another model, with another secret or none, an
unknown version (format 1 objects included) — is a miss, and vLLM
recomputes. The codecs that compute the check are in storage/sealing.py;
this module packs the fields and does the checksum-only case.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import xxhash

MAGIC = b"HCKV"
VERSION = 2
HEADER_BYTES = 64
# Bytes 0..FIELD_BYTES of the header: what the check covers with the payload.
FIELD_BYTES = 48
CHECK_BYTES = HEADER_BYTES - FIELD_BYTES
NONCE_BYTES = 12
# Protection modes (byte 32). 1 (a keyed-BLAKE3 MAC, before GMAC) is retired:
# its objects live under other keys (the mode is in the key namespace).
CHECKSUM, AEAD, MAC = 0, 2, 3
_NONCED = (AEAD, MAC)
_FIELDS = struct.Struct("<4sHHQ16sB3x12s")
_ZERO_NONCE = bytes(NONCE_BYTES)
assert _FIELDS.size == FIELD_BYTES


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def header_key_digest(header: np.ndarray) -> bytes:
    """The key digest a header holds (unchecked: the codec checks it)."""
    return header[16:32].tobytes()


def pack_fields(key: str, payload_bytes: int, protection: int,
                nonce: bytes = _ZERO_NONCE) -> bytes:
    """Header bytes 0..48 of an object of ``payload_bytes`` under ``key``."""
    return _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, payload_bytes, key_digest(key),
                        protection, nonce)


def fields_nonce(header: np.ndarray, key: str, payload_bytes: int,
                 protection: int) -> bytes | None:
    """The nonce field if header bytes 0..48 are what a reader of ``key``
    expects (else None: a miss). The check is the caller's."""
    if header.nbytes != HEADER_BYTES:
        return None
    magic, version, size, length, digest, mode, nonce = _FIELDS.unpack_from(header)
    if (magic != MAGIC or version != VERSION or size != HEADER_BYTES
            or length != payload_bytes or mode != protection or digest != key_digest(key)):
        return None
    if protection not in _NONCED and nonce != _ZERO_NONCE:
        return None
    return nonce


def checksum(fields: bytes, payload: np.ndarray) -> bytes:
    """xxh3-128 of the header fields and the payload."""
    h = xxhash.xxh3_128(fields)
    h.update(memoryview(payload))
    return h.digest()


def encode_header(key: str, payload: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The checksum-only header for ``payload`` stored under ``key`` (into
    ``out`` if given)."""
    header = out if out is not None else np.empty(HEADER_BYTES, np.uint8)
    assert header.nbytes == HEADER_BYTES, header.nbytes
    fields = pack_fields(key, payload.nbytes, CHECKSUM)
    header[:FIELD_BYTES] = np.frombuffer(fields, np.uint8)
    header[FIELD_BYTES:] = np.frombuffer(checksum(fields, payload), np.uint8)
    return header


def header_matches(header: np.ndarray, key: str, payload: np.ndarray) -> bool:
    """True iff ``header`` + ``payload`` is a valid checksum-only object for ``key``."""
    if fields_nonce(header, key, payload.nbytes, CHECKSUM) is None:
        return False
    fields = header[:FIELD_BYTES].tobytes()
    return header[FIELD_BYTES:].tobytes() == checksum(fields, payload)
