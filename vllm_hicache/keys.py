"""Page keys: the identity of an L2 page (and, later, of an L3 object).

A page holds one vLLM block, and its key is vLLM's block hash for that block
(``request.block_hashes[i]``). vLLM chains these hashes: the hash of block i
covers the tokens of blocks 0..i plus the request's extra keys (LoRA, cache
salt, multimodal inputs), so equal keys mean equal KV and salted or LoRA
requests never share pages by accident. Pure module: no torch, no vllm.
"""

from __future__ import annotations

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

