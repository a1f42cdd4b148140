"""The L3 storage secret: where it comes from, what is derived from it, and
that it is never shown.

``storage_secret`` (in ``hicache_storage_backend_extra_config``) is the
secret itself or ``@/path/to/file`` (the file's bytes, one trailing newline
stripped), which keeps it out of command lines, process listings and the
configuration vLLM logs. It is a key, not a password: at least
``MIN_SECRET_BYTES`` bytes, best 32 random ones (``head -c 32 /dev/urandom |
base64 > secret``). Every instance sharing the store's objects needs the same
secret.

Nothing uses the secret directly. HKDF-SHA256 (RFC 5869) derives one
independent value per label, so none reveals the secret or another:

    gmac          32-byte AES-256-GMAC key: the object MAC (storage/sealing.py)
    aead          32-byte AES-256-GCM key (storage_encrypt)
    namespace     8 bytes, as hex, in every object key (keys.py): instances
                  with different secrets never even look at each other's objects
    object names  the key that hides block hashes in object names
                  (storage_config.object_name_key)

The labels are the ``LABEL_*`` constants below, their one home.

A ``StorageSecret`` shows as ``<redacted>`` in ``repr``/``str``; errors name
the option (and the file), never the value. Pure module: no torch, no vllm.
"""

from __future__ import annotations

import hmac
from typing import Any

from vllm_hicache.option_file import read_option_file

OPTION = "storage_secret"
MIN_SECRET_BYTES = 16
# HKDF labels (module doc): changing one changes every derived key.
LABEL_GMAC = "gmac"
LABEL_AEAD = "aead"
LABEL_NAMESPACE = "namespace"
LABEL_OBJECT_NAMES = "object names"
# Longer is pointless (HKDF hashes it) and a sign the wrong file was named.
MAX_SECRET_BYTES = 4096
_LABEL_PREFIX = b"vllm_hicache/l3/v1/"


class StorageSecret:
    """Key material for authenticated (and encrypted) L3 objects."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes):
            raise TypeError(f"{OPTION} must be bytes")
        if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise ValueError(
                f"invalid {OPTION}: {len(secret)} bytes, expected {MIN_SECRET_BYTES} to "
                f"{MAX_SECRET_BYTES} (a random key, e.g. head -c 32 /dev/urandom | base64)"
            )
        self._secret = secret

    @classmethod
    def from_option(cls, value: Any) -> StorageSecret:
        """Parse the option: the secret, or ``@path`` to a file holding it."""
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"invalid {OPTION}: expected a non-empty string (the secret, or @/path/to/file)"
            )
        if not value.startswith("@"):
            return cls(value.encode())
        path = value[1:]
        try:
            data = read_option_file(path)
        except ValueError as err:
            # The path is not the secret; the error holds nothing else.
            raise ValueError(f"invalid {OPTION}: {err}") from None
        if data.endswith(b"\n"):
            data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
        try:
            return cls(data)
        except ValueError as err:
            raise ValueError(f"{err} (from the secret file {path!r})") from None

    def derive(self, label: str, length: int = 32) -> bytes:
        """An independent key for ``label`` (HKDF-SHA256, no salt)."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = _LABEL_PREFIX + label.encode()
        return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(
            self._secret
        )

    @property
    def namespace_tag(self) -> str:
        """16 hex digits naming this secret in object keys (one-way)."""
        return self.derive(LABEL_NAMESPACE, 8).hex()

    def __repr__(self) -> str:
        return "StorageSecret(<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StorageSecret):
            return NotImplemented
        return hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(self.namespace_tag)
