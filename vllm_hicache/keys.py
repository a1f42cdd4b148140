"""Page keys: the identity of an L2 page and of an L3 object.

A page holds one vLLM block, and its key is vLLM's block hash for that block
(``request.block_hashes[i]``). vLLM chains these hashes: the hash of block i
covers the tokens of blocks 0..i plus the request's extra keys (LoRA, cache
salt, multimodal inputs), so equal keys mean equal KV and salted or LoRA
requests never share pages by accident. An L3 object key is
``hc1-<16 hex of sha256(model|dtype|layout|block_size|tp_size)>-r<rank>-<hash hex>``
(``-mla-`` instead of ``-r<rank>-`` for MLA). Pure module: no torch, no vllm.
"""

from __future__ import annotations

import dataclasses
import hashlib
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



@dataclass(frozen=True)
class KeyNamespace:
    """What an L3 object's key must say besides the block hash (invariant 2:
    two models, dtypes, layouts, block sizes or TP shardings never share a
    key). MLA keeps one copy for all ranks: no rank in its keys."""

    # Model identity: name or path, plus revision when known.
    model: str
    # KV cache element type, e.g. "bfloat16".
    kv_dtype: str
    # Host pool layout: it decides the payload's byte order.
    mem_layout: str
    block_size: int
    tp_size: int
    tp_rank: int
    is_mla: bool = False

    @property
    def tag(self) -> str:
        """Filename-safe prefix of every key in this namespace."""
        ident = "|".join(
            str(v) for v in (self.model, self.kv_dtype, self.mem_layout, self.block_size,
                             "mla" if self.is_mla else self.tp_size)
        )
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        shard = "mla" if self.is_mla else f"r{self.tp_rank}"
        return f"hc1-{digest}-{shard}"

    def for_rank(self, tp_rank: int) -> KeyNamespace:
        return dataclasses.replace(self, tp_rank=tp_rank)

    def object_keys(self, hashes: Sequence[bytes]) -> list[str]:
        tag = self.tag
        return [f"{tag}-{bytes(h).hex()}" for h in hashes]
