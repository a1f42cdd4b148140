"""Page keys: the identity of an L2 page and of an L3 object.

A page holds one vLLM block, and its key is vLLM's block hash for that block
(``request.block_hashes[i]``). vLLM chains these hashes: the hash of block i
covers the tokens of blocks 0..i plus the request's extra keys (LoRA name and
path, cache salt, multimodal inputs), so equal keys mean equal tokens and
salted or LoRA requests never share pages by accident.

Invariant (L3): an object key names everything that decides the object's
bytes besides the tokens, so two instances whose bytes for the same tokens
could differ never share a key: the weights (model name and revision, plus
``model_version`` or a fingerprint of the weight files, plus the options
that change them when vLLM loads them: online quantization and
``hf_overrides``), the KV dtype, the
host layout and the exact byte order of a page's payload, the block size,
the TP and PP sharding and this shard's ranks. It also names how objects
are sealed: with a storage secret, its one-way tag (never the secret), so
instances with different secrets, or none, never look up each other's
objects. The format::

    hc4-<D>-<shard>-<block name>

    D      16 hex of sha256 over the JSON list [model, model_version,
           weights_fingerprint, kv_dtype, mem_layout, page_format,
           block_size, tp_size (or "mla", or "slices:<n>"), pp_size,
           pp_rank, protection, quantization, hf_overrides]
    shard  r<tp_rank>, or p<pp_rank>r<tp_rank> when pp_size > 1; MLA keeps
           one copy for all TP ranks: "mla" (p<pp_rank>mla); with head
           slices: s<slice> (p<pp_rank>s<slice>)
    block  the block hash in hex; with a storage secret, a keyed hash of it
           (blake2b-256 under a key derived from the secret), so whoever can
           list the store but lacks the secret cannot test whether a prompt
           they guess was cached by hashing it the way vLLM does

Head slices (heterogeneous TP, ``tp_lcm_size``): an object holds one of
``n`` equal runs of the model's KV heads instead of one TP rank's heads, so
its key and bytes do not depend on the TP size of the instance that wrote
it; the page format then describes one slice (``HeadSlicing``).

Tenants: vLLM folds a request's ``cache_salt`` into its first block's hash,
and the chain carries it into every later one, so requests with different
salts have different block hashes, hence different L2 pages and L3 keys.

``hc1`` keys (before the byte order and weights were named), ``hc2`` keys
(object format 1, before the sealing was named) and ``hc3`` keys (before
quantization and ``hf_overrides`` were named: an instance quantizing online
wrote under the same keys as one that did not) are never read.
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


def loadable_block_limit(num_tokens: int, block_size: int) -> int:
    """Most blocks a hit may cover: vLLM must still compute >= 1 token."""
    return max(0, (num_tokens - 1) // block_size)


# Bump when the meaning of an object's bytes changes for the same fields.
KEY_VERSION = "hc4"


@dataclass(frozen=True)
class HeadSlicing:
    """How KV heads map onto L3 head slices (``tp_lcm_size`` slices).

    vLLM gives TP rank r of T the contiguous heads [r*H/T, (r+1)*H/T) of the
    model's H KV heads (H >= T here). With ``num_slices`` S a multiple of T
    and a divisor of H, slice s is heads [s*H/S, (s+1)*H/S), and rank r
    holds exactly slices [r*S/T, (r+1)*S/T), in order: its local heads
    [j*H/S, (j+1)*H/S) are slice r*S/T + j. Any two TP sizes dividing S
    therefore cut the heads at the same places.
    """

    num_slices: int
    total_kv_heads: int
    tp_size: int

    def __post_init__(self) -> None:
        check_head_slicing(self.num_slices, self.tp_size, self.total_kv_heads)

    @property
    def heads_per_slice(self) -> int:
        return self.total_kv_heads // self.num_slices

    @property
    def slices_per_rank(self) -> int:
        return self.num_slices // self.tp_size

    def rank_slices(self, tp_rank: int) -> range:
        """The slices TP rank ``tp_rank`` holds, in the order of its heads."""
        per_rank = self.slices_per_rank
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def check_head_slicing(num_slices: int, tp_size: int, total_kv_heads: int,
                       is_mla: bool = False) -> None:
    """Refuse a ``tp_lcm_size`` that cannot cut this model's heads for this TP size."""
    where = "tp_lcm_size in hicache_storage_backend_extra_config"
    if is_mla:
        raise ValueError(
            f"{where} does not apply to MLA models: their L3 objects already hold one "
            "copy shared by every TP rank (and every TP size); remove tp_lcm_size"
        )
    if num_slices < 1 or num_slices % tp_size:
        raise ValueError(
            f"{where} is {num_slices}, which is not a multiple of this instance's "
            f"tensor_parallel_size={tp_size}; set it to a common multiple of the TP "
            "sizes of every instance sharing the store"
        )
    if total_kv_heads % num_slices:
        raise ValueError(
            f"{where} is {num_slices}, but the model's {total_kv_heads} KV heads cannot be "
            f"cut into {num_slices} equal slices; use a divisor of {total_kv_heads} "
            "that is a multiple of every instance's tensor_parallel_size"
        )


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
    # How vLLM transforms the weights as it loads them, canonical JSON ("" =
    # not at all; connector/l3_identity.weights_options): the quantization
    # method and config (e.g. online --quantization fp8 of a bf16
    # checkpoint), and hf_overrides (changed config.json values).
    quantization: str = ""
    hf_overrides: str = ""
    pp_size: int = 1
    pp_rank: int = 0
    # How objects are sealed (StorageConfig.key_protection): "" = checksums
    # only, else "mac:<tag>" or "aead:<tag>", <tag> a one-way derivation of
    # the storage secret.
    protection: str = ""
    # Head slices (HeadSlicing.num_slices; 0 = objects per TP rank): then
    # the key names ``head_slice``, one of this rank's slices, and neither
    # the TP size nor the TP rank.
    head_slices: int = 0
    head_slice: int = 0
    # With a storage secret: the key object names are keyed with
    # (StorageConfig.object_name_key); b"" = names carry the block hash. Not
    # in the digest (the protection's tag already is); never shown.
    name_key: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(
                f"bad L3 key shard: tp_rank={self.tp_rank} of tp_size={self.tp_size}, "
                f"pp_rank={self.pp_rank} of pp_size={self.pp_size}"
            )
        if self.head_slices and self.head_slice not in self._slicing_range():
            raise ValueError(
                f"bad L3 key shard: head_slice={self.head_slice} is not one of tp_rank="
                f"{self.tp_rank}'s slices {list(self._slicing_range())} of {self.head_slices}"
            )

    def _slicing_range(self) -> range:
        per_rank = self.head_slices // self.tp_size
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)

    @functools.cached_property
    def tag(self) -> str:
        """Filename-safe prefix of every key in this namespace (computed once:
        it is asked for on every L3 lookup and batch)."""
        # JSON, not "|".join: free-form strings (model_version, paths) must
        # not be able to imitate another field list.
        ident = json.dumps([
            self.model, self.model_version, self.weights_fingerprint, self.kv_dtype,
            self.mem_layout, self.page_format, self.block_size,
            self._sharding(), self.pp_size, self.pp_rank, self.protection,
            self.quantization, self.hf_overrides,
        ])
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        if self.is_mla:
            shard = "mla"
        elif self.head_slices:
            shard = f"s{self.head_slice}"
        else:
            shard = f"r{self.tp_rank}"
        if self.pp_size > 1:
            shard = f"p{self.pp_rank}{shard}"
        return f"{KEY_VERSION}-{digest}-{shard}"

    def _sharding(self) -> int | str:
        """How the heads are cut into objects (the digest's TP field)."""
        if self.is_mla:
            return "mla"
        return f"slices:{self.head_slices}" if self.head_slices else self.tp_size

    def for_rank(self, tp_rank: int, pp_rank: int | None = None) -> KeyNamespace:
        """The namespace of another rank (with head slices: its first slice)."""
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        head_slice = tp_rank * (self.head_slices // self.tp_size)
        return dataclasses.replace(self, tp_rank=tp_rank, pp_rank=pp_rank,
                                   head_slice=head_slice)

    def page_namespaces(self) -> list[KeyNamespace]:
        """One namespace per object of one of this rank's pages, in the order
        of the rank's heads: itself, or with head slices one per slice."""
        if not self.head_slices:
            return [self]
        return [dataclasses.replace(self, head_slice=s) for s in self._slicing_range()]

    def object_keys(self, hashes: Sequence[bytes]) -> list[str]:
        tag = self.tag
        if not self.name_key:
            return [f"{tag}-{bytes(h).hex()}" for h in hashes]
        keyed = hashlib.blake2b(key=self.name_key, digest_size=32)
        names = []
        for h in hashes:
            one = keyed.copy()  # the key block is hashed once, not per name
            one.update(h)
            names.append(f"{tag}-{one.hexdigest()}")
        return names
