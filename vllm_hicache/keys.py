"""Page keys: the identity of an L2 page and of an L3 object.

A page holds one vLLM block, and its key is vLLM's block hash for that block
(``request.block_hashes[i]``). vLLM chains these hashes: the hash of block i
covers the tokens of blocks 0..i plus the request's extra keys (LoRA name and
path, cache salt, multimodal inputs), so equal keys mean equal tokens and
salted or LoRA requests never share pages by accident.

Invariant (L3): an object key names everything that decides the object's
bytes besides the tokens, so two instances whose bytes for the same tokens
could differ never share a key: the weights (model name and revision, plus
``model_version`` or a fingerprint of the weight files), the KV dtype, the
host layout and the exact byte order of a page's payload, the block size,
the TP and PP sharding and this shard's ranks. It also names how objects
are sealed: with a storage secret, its one-way tag (never the secret), so
instances with different secrets, or none, never look up each other's
objects. The format::

    hc3-<D>-<shard>-<block hash hex>

    D      16 hex of sha256 over the JSON list [model, model_version,
           weights_fingerprint, kv_dtype, mem_layout, page_format,
           block_size, tp_size (or "mla"), pp_size, pp_rank, protection]
    shard  r<tp_rank>, or p<pp_rank>r<tp_rank> when pp_size > 1; MLA keeps
           one copy for all TP ranks: "mla" (p<pp_rank>mla)

Tenants: vLLM folds a request's ``cache_salt`` into its first block's hash,
and the chain carries it into every later one, so requests with different
salts have different block hashes, hence different L2 pages and L3 keys.

``hc1`` keys (before the byte order and weights were named) and ``hc2`` keys
(object format 1, before the sealing was named) are never read.
Pure module: no torch, no vllm.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

# vLLM's BlockHash: opaque bytes, chained over the prefix.
BlockHash = NewType("BlockHash", bytes)

# vLLM appends a 4-byte big-endian KV-cache group id to a BlockHash to form
# the key of its own block table (BlockHashWithGroupId).
_GROUP_ID_BYTES = 4


def block_hash_of_group_key(key: bytes) -> BlockHash:
    """The BlockHash inside one of vLLM's BlockHashWithGroupId keys."""
    return BlockHash(bytes(key[:-_GROUP_ID_BYTES]))


def full_block_count(num_tokens: int, block_size: int) -> int:
    """Number of complete blocks in ``num_tokens`` tokens."""
    return num_tokens // block_size


def loadable_block_limit(num_tokens: int, block_size: int) -> int:
    """Most blocks a hit may cover: vLLM must still compute >= 1 token."""
    return max(0, (num_tokens - 1) // block_size)


# Bump when the meaning of an object's bytes changes for the same fields.
KEY_VERSION = "hc3"


@dataclass(frozen=True)
class KeyNamespace:
    """What an L3 object's key must say besides the block hash (see the
    module docstring). MLA keeps one copy for all TP ranks: no TP rank in its
    keys."""

    # Model identity: name or path, plus "@revision" when known.
    model: str
    # KV cache element type, e.g. "bfloat16".
    kv_dtype: str
    # Host pool layout (hicache_mem_layout).
    mem_layout: str
    block_size: int
    tp_size: int
    tp_rank: int
    is_mla: bool = False
    # Byte order of one page's payload as stored (element size, then axes
    # with sizes and strides): for page_first_direct the device's native
    # block order, which differs between attention backends and KV layouts.
    page_format: str = ""
    # The user's name for these weights (kv_connector_extra_config).
    model_version: str = ""
    # Cheap digest of the weight files when model_version is not given.
    weights_fingerprint: str = ""
    pp_size: int = 1
    pp_rank: int = 0
    # How objects are sealed (StorageConfig.key_protection): "" = checksums
    # only, else "mac:<tag>" or "aead:<tag>", <tag> a one-way derivation of
    # the storage secret.
    protection: str = ""

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(
                f"bad L3 key shard: tp_rank={self.tp_rank} of tp_size={self.tp_size}, "
                f"pp_rank={self.pp_rank} of pp_size={self.pp_size}"
            )

    @functools.cached_property
    def tag(self) -> str:
        """Filename-safe prefix of every key in this namespace (computed once:
        it is asked for on every L3 lookup and batch)."""
        # JSON, not "|".join: free-form strings (model_version, paths) must
        # not be able to imitate another field list.
        ident = json.dumps([
            self.model, self.model_version, self.weights_fingerprint, self.kv_dtype,
            self.mem_layout, self.page_format, self.block_size,
            "mla" if self.is_mla else self.tp_size, self.pp_size, self.pp_rank,
            self.protection,
        ])
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        shard = "mla" if self.is_mla else f"r{self.tp_rank}"
        if self.pp_size > 1:
            shard = f"p{self.pp_rank}{shard}"
        return f"{KEY_VERSION}-{digest}-{shard}"

    def for_rank(self, tp_rank: int, pp_rank: int | None = None) -> KeyNamespace:
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        return dataclasses.replace(self, tp_rank=tp_rank, pp_rank=pp_rank)

    def object_keys(self, hashes: Sequence[bytes]) -> list[str]:
        tag = self.tag
        return [f"{tag}-{bytes(h).hex()}" for h in hashes]
