"""Object codecs: how a page becomes a stored object and back (format.py).

    checksum  no secret: xxh3-128 over the header fields and the payload.
              Catches corruption; anyone who can write the store can forge.
    gmac      storage_secret: AES-256-GMAC (128-bit tag) over the header
              fields and the payload, a fresh random 96-bit nonce per
              object (in the header). Whoever lacks the secret can neither
              forge an object nor move one to another key (the key's digest
              is a covered field). The payload stays readable.
    aead      storage_secret + storage_encrypt: AES-256-GCM, the payload
              stored as ciphertext, the header fields as associated data,
              the GCM tag as the check. A fresh random 96-bit nonce per
              object: by NIST SP 800-38D a key may seal up to 2^32 objects
              that way (collision odds below 2^-32); rotate the secret
              before one store has seen four billion writes.

Why GMAC for the MAC: it runs on every store and load. GCM's GHASH with
carry-less multiply (PCLMULQDQ/VPCLMULQDQ, ARMv8 PMULL: every server CPU
vLLM runs on) checked 1 MiB pages at 10-17 GB/s per thread on the 2-core
test VM, against 2-6 GB/s for keyed BLAKE3 and under 1 GB/s for keyed
blake2b (benchmarks/bench_l3_seal.py, docs/benchmarks.md); OpenSSL runs it
without the GIL, so a batch's objects are checked on several threads
(PageStore). It is AES-GCM with the payload as associated data and the 48
header bytes as the (discarded) plaintext: the tag covers both. GCM's bound
applies as for the aead codec: random nonces, so up to 2^32 objects sealed
per key. A reader recomputes the tag under the stored nonce and compares;
forging one is forging a GCM tag. AES-GCM (aead) needs no separate MAC: its
tag authenticates the header fields and the ciphertext.

The MAC and AEAD keys are derived from the secret (storage_secret.py); the
codec never holds the secret itself. The mac and checksum codecs check and
store the payload where it is (the pool page: zero copy); the aead codec
needs a scratch buffer per object (``scratch_bytes``) for the ciphertext and
its tag, which the caller provides and reuses.
"""

from __future__ import annotations

import hmac
import os
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vllm_hicache.storage import format as fmt
from vllm_hicache.storage_secret import LABEL_AEAD, LABEL_GMAC, StorageSecret

_TAG = fmt.CHECK_BYTES


class ObjectCodec(ABC):
    """Seals pages into objects and opens them; stateless, thread-safe."""

    # format.py's protection byte, and the name used in configs and logs.
    protection: ClassVar[int]
    name: ClassVar[str]
    # seal/open release the GIL: a batch's objects can be checked on several
    # threads at once (PageStore does).
    releases_gil: ClassVar[bool] = False

    def scratch_bytes(self, payload_bytes: int) -> int:
        """Bytes of scratch one object needs (0: none, body = payload)."""
        return 0

    def body(self, payload: np.ndarray, scratch: np.ndarray | None) -> np.ndarray:
        """The buffer a stored object's payload travels in: the page itself,
        or (codecs with scratch) a view of ``scratch``."""
        return payload

    @abstractmethod
    def seal(self, key: str, payload: np.ndarray, header: np.ndarray,
             scratch: np.ndarray | None = None) -> np.ndarray:
        """Fill ``header`` for ``payload`` under ``key``; the body to store
        after it (``body(payload, scratch)``, filled)."""

    @abstractmethod
    def open(self, key: str, header: np.ndarray, body: np.ndarray, payload: np.ndarray,
             scratch: np.ndarray | None = None) -> bool:
        """True iff ``header`` + ``body`` (as read into ``body(payload,
        scratch)``) is a valid object for ``key``; then ``payload`` holds the
        page. False leaves ``payload`` unspecified."""


class ChecksumCodec(ObjectCodec):
    protection = fmt.CHECKSUM
    name = "checksum"

    def seal(self, key, payload, header, scratch=None):
        fmt.encode_header(key, payload, out=header)
        return payload

    def open(self, key, header, body, payload, scratch=None):
        return fmt.header_matches(header, key, payload)


class MacCodec(ObjectCodec):
    protection = fmt.MAC
    name = "gmac"
    releases_gil = True  # OpenSSL's GCM runs without it

    def __init__(self, secret: StorageSecret) -> None:
        self._gcm = AESGCM(secret.derive(LABEL_GMAC))

    def _tag(self, nonce: bytes, fields: bytes, payload: np.ndarray) -> bytes:
        # encrypt() returns the fields' ciphertext, then the tag: keep the tag.
        return self._gcm.encrypt(nonce, fields, memoryview(payload))[-_TAG:]

    def seal(self, key, payload, header, scratch=None):
        nonce = os.urandom(fmt.NONCE_BYTES)
        fields = fmt.pack_fields(key, payload.nbytes, self.protection, nonce)
        header[:fmt.FIELD_BYTES] = np.frombuffer(fields, np.uint8)
        header[fmt.FIELD_BYTES:] = np.frombuffer(self._tag(nonce, fields, payload), np.uint8)
        return payload

    def open(self, key, header, body, payload, scratch=None):
        nonce = fmt.fields_nonce(header, key, payload.nbytes, self.protection)
        if nonce is None:
            return False
        expected = self._tag(nonce, header[:fmt.FIELD_BYTES].tobytes(), payload)
        return hmac.compare_digest(header[fmt.FIELD_BYTES:].tobytes(), expected)


class AeadCodec(ObjectCodec):
    protection = fmt.AEAD
    name = "aead"

    def __init__(self, secret: StorageSecret) -> None:
        self._aead = AESGCM(secret.derive(LABEL_AEAD))
        # Older cryptography releases lack the *_into calls: one copy more.
        self._into = hasattr(self._aead, "encrypt_into")

    def scratch_bytes(self, payload_bytes: int) -> int:
        return payload_bytes + _TAG  # ciphertext, then the tag (as AESGCM lays them out)

    def body(self, payload, scratch):
        assert scratch is not None and scratch.nbytes == payload.nbytes + _TAG
        return scratch[:payload.nbytes]

    def seal(self, key, payload, header, scratch=None):
        nonce = os.urandom(fmt.NONCE_BYTES)
        fields = fmt.pack_fields(key, payload.nbytes, self.protection, nonce)
        body = self.body(payload, scratch)
        if self._into:
            self._aead.encrypt_into(nonce, payload, fields, scratch)
        else:
            scratch[:] = np.frombuffer(self._aead.encrypt(nonce, payload.tobytes(), fields),
                                       np.uint8)
        header[:fmt.FIELD_BYTES] = np.frombuffer(fields, np.uint8)
        header[fmt.FIELD_BYTES:] = scratch[payload.nbytes:]
        return body

    def open(self, key, header, body, payload, scratch=None):
        nonce = fmt.fields_nonce(header, key, payload.nbytes, self.protection)
        if nonce is None:
            return False
        scratch[payload.nbytes:] = header[fmt.FIELD_BYTES:]
        fields = header[:fmt.FIELD_BYTES].tobytes()
        try:
            if self._into:
                self._aead.decrypt_into(nonce, scratch, fields, payload)
            else:
                plain = self._aead.decrypt(nonce, scratch.tobytes(), fields)
                payload[:] = np.frombuffer(plain, np.uint8)
        except InvalidTag:
            return False
        return True


def make_codec(secret: StorageSecret | None, encrypt: bool = False) -> ObjectCodec:
    """The codec for a StorageConfig's ``secret`` and ``encrypt``."""
    if secret is None:
        if encrypt:
            raise ValueError("storage_encrypt=true needs storage_secret")
        return ChecksumCodec()
    return AeadCodec(secret) if encrypt else MacCodec(secret)
