"""The node tier's page segment: one file in a tmpfs (``/dev/shm``), mapped
shared by every member.

Format (little-endian), offsets in bytes:

    0      segment header (``HEADER_BYTES``): magic, format version, the
           requested capacity, page size, slot count, slot stride, data
           offset, the identity digest (sha256 of the identity string) and
           the creation epoch (16 random bytes, also in the index: a segment
           and an index of different creations never pair up)
    512    the drop count, u64: grows (inside the index transaction) each
           time pages are dropped rather than evicted (a page that failed
           its checks, the admin API's clear); readers forget the slots they
           remembered (hints.py) when it changes
    4096   slot headers, ``SLOT_HEADER_BYTES`` (96) each, slot i at
           4096 + 96 i: generation u64 | length u64 | checksum u64 | key
           length u8 | 7 bytes of padding | key (``KEY_MAX_BYTES``, 64: a
           vLLM block hash with its KV-cache group id is 36)
    data   ``data_offset`` (4096-aligned): slot i's bytes at
           data_offset + i * slot_stride, ``page_bytes`` of them

A slot header is the *seal*: written by the member that filled the slot,
after the bytes and before the index publishes the slot, with the
generation the index gave that reservation. A reader trusts a slot's bytes
only while the header's generation and key equal the index's (a slot freed
or reused since has a newer generation in the index), so a page whose writer
died, or that belongs to another key, is a miss, never wrong bytes.

Before a member writes any byte of a slot it reserved, it *unseals* it: the
header gets the reservation's generation and no key. So a slot's bytes
change only while its seal names no key, and a reader that finds the same
seal before and after copying a slot copied bytes no writer touched, pinned
or not (``PINLESS_READS`` says where that holds).

Why a plain file and ``mmap`` rather than ``multiprocessing.shared_memory``:
before Python 3.13 every attacher's resource tracker unlinks the segment
when that process exits (also on SIGKILL of the creator, the tracker being
another process), which would delete the tier under the surviving members.

The file's blocks are allocated up front (``posix_fallocate``): a tmpfs
that cannot hold the tier fails here with a clear error, instead of a
SIGBUS in whichever member first touches a page the tmpfs cannot back.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hicache.node.errors import NodeTierError

MAGIC = b"HICNODE1"
FORMAT_VERSION = 2  # 2: writers unseal before writing; the drop count
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 96
KEY_MAX_BYTES = 64
# Slot data starts on a cache line; the data area on a memory page, so that
# registering the segment for DMA (cudaHostRegister) covers whole pages.
_SLOT_ALIGN_BYTES = 64
_DATA_ALIGN_BYTES = 4096

# Whether a reader may copy a slot without pinning it, trusting the seal
# read before and after the copy: sound where other cores see a writer's
# stores (unseal, then bytes) and a reader's loads (seal, bytes, seal) in
# program order, as x86-64's total store order guarantees; elsewhere (Arm's
# weaker order) readers pin the slot, and the index keeps writers out.
PINLESS_READS = platform.machine().lower() in ("x86_64", "amd64")

_HEADER = struct.Struct("<8sIIQQQQQ32s16s")
_DROPS = struct.Struct("<Q")
_DROPS_OFFSET = 512
assert _HEADER.size <= _DROPS_OFFSET
_SLOT = struct.Struct(f"<QQQB7x{KEY_MAX_BYTES}s")
assert _SLOT.size == SLOT_HEADER_BYTES


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class Geometry:
    """Where everything sits in a segment of ``capacity_bytes``."""

    capacity_bytes: int
    page_bytes: int
    num_slots: int
    slot_stride: int
    data_offset: int

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_stride

    @classmethod
    def for_capacity(cls, capacity_bytes: int, page_bytes: int) -> Geometry:
        """The most slots of ``page_bytes`` whose segment fits ``capacity_bytes``
        (headers included); NodeTierError when not even one fits."""
        stride = _align(page_bytes, _SLOT_ALIGN_BYTES)
        slots = max(0, (capacity_bytes - HEADER_BYTES) // (stride + SLOT_HEADER_BYTES))
        while slots > 0:
            data_offset = _align(HEADER_BYTES + slots * SLOT_HEADER_BYTES, _DATA_ALIGN_BYTES)
            if data_offset + slots * stride <= capacity_bytes:
                return cls(capacity_bytes, page_bytes, slots, stride, data_offset)
            slots -= 1
        raise NodeTierError(
            f"node tier capacity_bytes={capacity_bytes} holds no page of page_bytes="
            f"{page_bytes}: it needs at least "
            f"{_align(HEADER_BYTES + SLOT_HEADER_BYTES, _DATA_ALIGN_BYTES) + stride} bytes")


@dataclass(frozen=True)
class SlotSeal:
    """A slot header as read back."""

    generation: int
    length: int
    checksum: int
    key: bytes


def check_free_space(directory: str, needed_bytes: int) -> None:
    """NodeTierError naming the tmpfs and how to grow it when ``directory``'s
    file system cannot hold ``needed_bytes`` more."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < needed_bytes:
        raise NodeTierError(_no_space(directory, needed_bytes, free))


def _no_space(directory: str, needed_bytes: int, free_bytes: int | None) -> str:
    have = "" if free_bytes is None else f", {free_bytes / 2**30:.2f} GiB free"
    return (f"node tier: {directory} cannot hold the tier's {needed_bytes / 2**30:.2f} GiB"
            f"{have}. Make the tmpfs larger (Docker: --shm-size, or --ipc=host to use the "
            "host's /dev/shm; Kubernetes: a larger emptyDir sizeLimit with medium Memory; "
            "a plain tmpfs: mount -o remount,size=...) or ask for a smaller node tier")


class Segment:
    """One member's mapping of the segment file."""

    def __init__(self, path: str, geometry: Geometry, identity_digest: bytes, epoch: bytes,
                 fd: int) -> None:
        self.path = path
        self.geometry = geometry
        self.identity_digest = identity_digest
        self.epoch = epoch
        self._map = mmap.mmap(fd, geometry.file_bytes, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)  # the mapping keeps the memory; no lock is ever taken on this file
        self._view: memoryview | None = memoryview(self._map)

    # --- creation and attachment --------------------------------------------

    @classmethod
    def create(cls, path: str, geometry: Geometry, identity_digest: bytes,
               epoch: bytes) -> Segment:
        """A new segment file at ``path`` (which must not exist), its blocks
        allocated and its header written."""
        check_free_space(os.path.dirname(path), geometry.file_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, geometry.file_bytes)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise NodeTierError(_no_space(os.path.dirname(path), geometry.file_bytes, None)
                                + f" ({e.strerror})") from e
        seg = cls(path, geometry, identity_digest, epoch, fd)
        _HEADER.pack_into(seg._map, 0, MAGIC, FORMAT_VERSION, 0, geometry.capacity_bytes,
                          geometry.page_bytes, geometry.num_slots, geometry.slot_stride,
                          geometry.data_offset, identity_digest, epoch)
        return seg

    @classmethod
    def attach(cls, path: str) -> Segment:
        """The existing segment at ``path``; NodeTierError when it is not one."""
        fd = os.open(path, os.O_RDWR)
        try:
            raw = os.pread(fd, _HEADER.size, 0)
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        if len(raw) < _HEADER.size:
            os.close(fd)
            raise NodeTierError(f"node tier segment {path} is truncated ({size} bytes)")
        (magic, version, _, capacity, page_bytes, slots, stride, data_offset, digest,
         epoch) = _HEADER.unpack(raw)
        geometry = Geometry(capacity, page_bytes, slots, stride, data_offset)
        if magic != MAGIC or version != FORMAT_VERSION or size < geometry.file_bytes:
            os.close(fd)
            raise NodeTierError(
                f"node tier segment {path} is not a format-{FORMAT_VERSION} segment of its "
                f"declared size (magic {magic!r}, version {version}, {size} bytes)")
        return cls(path, geometry, digest, epoch, fd)

    # --- slots -------------------------------------------------------------

    def buffer(self) -> memoryview:
        """The whole mapping (writable)."""
        return self._buffer()

    def _buffer(self) -> memoryview:
        if self._view is None:
            raise NodeTierError(f"node tier segment {self.path} is closed")
        return self._view

    def data(self, slot: int) -> memoryview:
        """Slot ``slot``'s ``page_bytes`` (writable)."""
        g = self.geometry
        if not 0 <= slot < g.num_slots:
            raise IndexError(f"slot {slot} outside 0..{g.num_slots - 1}")
        start = g.data_offset + slot * g.slot_stride
        return self._buffer()[start:start + g.page_bytes]

    def write_seal(self, slot: int, seal: SlotSeal) -> None:
        _SLOT.pack_into(self._buffer(), HEADER_BYTES + slot * SLOT_HEADER_BYTES,
                        seal.generation, seal.length, seal.checksum, len(seal.key), seal.key)

    def drops(self) -> int:
        """The drop count (see the format)."""
        return _DROPS.unpack_from(self._buffer(), _DROPS_OFFSET)[0]

    def count_drop(self) -> None:
        """Add one to the drop count; only inside an index write transaction,
        which serialises this read-modify-write between members."""
        _DROPS.pack_into(self._buffer(), _DROPS_OFFSET, self.drops() + 1)

    def unseal(self, slot: int, generation: int) -> None:
        """Mark a reserved slot as being written (its new generation, no key):
        before its first byte changes, so that no seal check passes while it
        does."""
        _SLOT.pack_into(self._buffer(), HEADER_BYTES + slot * SLOT_HEADER_BYTES,
                        generation, 0, 0, 0, b"")

    def seals_match(self, slots: Sequence[int], generations: Sequence[int],
                    keys: Sequence[bytes]) -> int:
        """How many leading slots carry a seal of their generation and key
        (and a length within a page): ``read_seal`` for many slots, without
        a SlotSeal per slot (a load checks every page twice)."""
        buf, limit, unpack = self._buffer(), self.geometry.page_bytes, _SLOT.unpack_from
        for i, (slot, generation, key) in enumerate(zip(slots, generations, keys)):
            gen, length, _, key_len, stored = unpack(buf, HEADER_BYTES + slot * SLOT_HEADER_BYTES)
            if gen != generation or length > limit or stored[:min(key_len, KEY_MAX_BYTES)] != key:
                return i
        return len(slots)

    def read_seal(self, slot: int) -> SlotSeal:
        generation, length, checksum, key_len, key = _SLOT.unpack_from(
            self._buffer(), HEADER_BYTES + slot * SLOT_HEADER_BYTES)
        return SlotSeal(generation, length, checksum, key[:min(key_len, KEY_MAX_BYTES)])

    def close(self) -> None:
        """Unmap. Views handed out earlier must be released first; a mapping
        still exported is left to the garbage collector."""
        if self._view is None:
            return
        view, self._view = self._view, None
        try:
            view.release()
            self._map.close()
        except BufferError:
            pass
