"""``NodeTier``: one process's membership of a node tier (the package
docstring gives the design; segment.py, index.py and lease.py the formats;
membership.py how a tier is joined, reclaim.py how dead members' holdings
are taken back).

Who calls what: a process that keeps KV pages joins once (``join``) and
leaves once (``leave``). To publish a page it ``reserve``s slots (getting the
keys evicted to make room, for its KV events), fills each slot (``write``, or
``view`` for a copy engine that writes in place) and ``seal``s it under its
key; a slot it cannot fill goes back with ``abort``. To use pages it asks
``lookup`` how long a prefix of its keys is present, ``read``s pages into its
own buffers (a page whose seal does not verify is a miss), and ``pin``s
pages it will read later so that no member evicts them meanwhile. A
background thread (every ``sweep_interval_s``) and every reservation that
comes back short reclaim what dead members held. ``stats`` and
``check_integrity`` are for metrics and tests.

A ``NodeTier`` may be used from several threads of the process that
joined (an I/O pool, a lookup thread): index operations take turns on the
one connection, copies run side by side. A forked child must join on its
own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from vllm_hicache.node.errors import NodeTierError
from vllm_hicache.node.hints import SlotHints
from vllm_hicache.node.index import Claimed, Found
from vllm_hicache.node.membership import Joined, index_path, join_tier, members_dir
from vllm_hicache.node.reclaim import Sweeper, probe_and_release, reclaim_dead
from vllm_hicache.node.segment import KEY_MAX_BYTES, PINLESS_READS, Geometry, SlotSeal

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
# Most slots a process remembers (hints.py), about 250 bytes each (16 MiB): 128 GiB
# of pages of 2 MiB, the hot part of a tier that a reader reads again.
MAX_HINTS = 1 << 16


class HeldPages(list[Found]):
    """What ``hold_pages`` found, in key order; the first ``checked`` of them
    had their seals checked as they were found (remembered slots), so a
    reader checks the rest before its copy."""

    def __init__(self, pages: Sequence[Found] = (), checked: int = 0) -> None:
        super().__init__(pages)
        self.checked = checked


@dataclass(frozen=True)
class Reservation:
    """A slot this member may fill, then seal or abort."""

    slot: int
    gen: int


@dataclass(frozen=True)
class Reserved:
    """What ``reserve`` got: the slots, and the keys evicted to make room."""

    slots: list[Reservation]
    evicted_keys: list[bytes]


@dataclass(frozen=True)
class MemberStats:
    hits: int
    misses: int
    inserts: int
    evictions: int


@dataclass(frozen=True)
class NodeTierStats:
    name: str
    capacity_bytes: int
    page_bytes: int
    num_slots: int
    free_slots: int
    reserved_slots: int
    sealed_slots: int
    pinned_slots: int
    members: dict[str, MemberStats] = field(default_factory=dict)

    @property
    def occupancy_bytes(self) -> int:
        return self.sealed_slots * self.page_bytes


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = list(keys)
    for i, key in enumerate(out):
        if not isinstance(key, bytes):
            raise TypeError(f"node tier key {i} is a {type(key).__name__}, not bytes")
        if not 1 <= len(key) <= KEY_MAX_BYTES:
            raise ValueError(f"node tier key {i} has {len(key)} bytes; 1 to {KEY_MAX_BYTES} "
                             "are allowed")
    return out


def _writable(buffer: object, page_bytes: int, what: str) -> memoryview:
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is a {type(buffer).__name__}, not a buffer") from None
    if view.readonly or not view.c_contiguous:
        raise ValueError(f"{what} must be a writable, C-contiguous buffer")
    if view.nbytes < page_bytes:
        raise ValueError(f"{what} has {view.nbytes} bytes; a page needs {page_bytes}")
    return view.cast("B")


class NodeTier:
    """This process's membership of a node tier; made by ``join``."""

    def __init__(self, name: str, joined: Joined, lock_timeout_s: float,
                 sweep_interval_s: float) -> None:
        self.name = name
        self.directory = joined.directory
        self.member_id = joined.member_id
        self._segment = joined.segment
        self._index = joined.index
        self._lease = joined.lease
        self._members_dir = members_dir(joined.directory)
        self._pid = os.getpid()
        self._left = False
        # Whether ``hold_pages`` reads without pins (segment.py says where it
        # may); tests turn it off to run the pinned protocol on x86-64.
        self.pinless_reads = PINLESS_READS
        self._hints = SlotHints(min(self._segment.geometry.num_slots, MAX_HINTS),
                                self._segment.seals_match)
        self._sweeper = Sweeper(name, index_path(joined.directory), self._members_dir,
                                joined.member_id, lock_timeout_s, sweep_interval_s)

    # --- joining and leaving ------------------------------------------------------

    @classmethod
    def join(cls, name: str, identity: str, capacity_bytes: int, page_bytes: int, *,
             root: str = DEFAULT_ROOT, eviction: str = "lru", lock_timeout_s: float = 10.0,
             sweep_interval_s: float = 1.0) -> NodeTier:
        """Join (creating it when absent) the node tier ``name`` of ``identity``.

        The first member sizes the tier: a joiner asking for another
        capacity, page size or eviction policy gets NodeTierError while any
        member lives, and replaces the tier (its pages are lost) when none
        does. A different ``identity`` is a different tier."""
        joined = join_tier(name, identity, capacity_bytes, page_bytes, root, eviction,
                           lock_timeout_s, sweep_interval_s)
        return cls(name, joined, lock_timeout_s, sweep_interval_s)

    def leave(self) -> None:
        """Stop sweeping, drop this member's pins and reservations, release the
        lease. Its sealed pages stay for the other and later members.
        Idempotent."""
        if self._left:
            return
        self._left = True
        self._sweeper.stop()
        try:
            if os.getpid() == self._pid:
                freed = self._index.remove_member(self.member_id)
                self._lease.release()
                logger.info("HiCache node tier %r: %s left (%d reservations, %d pins released)",
                            self.name, self.member_id, freed.reservations, freed.pins)
        finally:
            self._index.close()
            self._segment.close()

    def __enter__(self) -> NodeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def _live(self) -> None:
        if self._left:
            raise NodeTierError(f"node tier {self.name!r}: this member has left")
        if os.getpid() != self._pid:
            raise NodeTierError(f"node tier {self.name!r} was joined by process {self._pid}; "
                                "a forked child must join on its own")

    # --- lookups and reads ---------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a sealed page (pins nothing: a page
        may be evicted before it is read; ``pin`` to keep it)."""
        self._live()
        return len(self._index.find(_check_keys(keys)))

    def pin(self, keys: Sequence[bytes]) -> int:
        """Pin the longest sealed prefix of ``keys`` against eviction; returns
        its length. Pins count: each pin is undone by one ``unpin``."""
        self._live()
        return len(self._index.pin(self.member_id, _check_keys(keys)))

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one of this member's pins on each of ``keys`` it pins."""
        self._live()
        self._index.unpin(self.member_id, self._index.pinned_slots(self.member_id,
                                                                   _check_keys(keys)))

    def read(self, key: bytes, out: object, verify_checksum: bool = False) -> bool:
        """Copy ``key``'s page into ``out``; False (``out`` unspecified) on a miss."""
        return self.read_prefix([key], [out], verify_checksum) == 1

    def read_prefix(self, keys: Sequence[bytes], outs: Sequence[object],
                    verify_checksum: bool = False) -> int:
        """Copy the pages of the longest present prefix of ``keys`` into
        ``outs`` (writable buffers of at least ``page_bytes`` each); returns
        how many were copied. The pages are pinned while copied; a page whose
        seal (generation and key; with ``verify_checksum`` also the checksum
        of its bytes) does not verify ends the prefix and is freed."""
        self._live()
        keys = _check_keys(keys)
        if len(outs) != len(keys):
            raise ValueError(f"read_prefix: {len(keys)} keys but {len(outs)} buffers")
        page_bytes = self._segment.geometry.page_bytes
        views = [_writable(out, page_bytes, f"buffer {i}") for i, out in enumerate(outs)]
        found = self._index.pin(self.member_id, keys)
        copied = 0
        bad: Found | None = None
        try:
            for hit, dst in zip(found, views):
                if not self._copy_out(hit, dst, verify_checksum):
                    bad = hit
                    break
                copied += 1
        finally:
            self._index.unpin(self.member_id, [f.slot for f in found], hits=copied,
                              misses=len(keys) - copied)
        if bad is not None:
            logger.warning("HiCache node tier %r: the page of key %s in slot %d failed its "
                           "seal; dropped", self.name, bad.key.hex(), bad.slot)
            self._index.drop(bad, self._segment.count_drop)
        return copied

    def _copy_out(self, hit: Found, dst: memoryview, verify_checksum: bool) -> bool:
        seal = self._segment.read_seal(hit.slot)
        if not self._seal_matches(seal, hit):
            return False
        dst[:seal.length] = self._segment.data(hit.slot)[:seal.length]
        if verify_checksum and xxhash.xxh3_64_intdigest(dst[:seal.length]) != seal.checksum:
            return False
        # Read again after the copy: a slot refilled meanwhile (which a pin
        # forbids) would show a newer generation.
        return self._seal_matches(self._segment.read_seal(hit.slot), hit)

    def _seal_matches(self, seal: SlotSeal, hit: Found) -> bool:
        return (seal.generation == hit.gen and seal.key == hit.key
                and seal.length <= self._segment.geometry.page_bytes)

    # --- direct reads: a copy engine reads the pinned slots in place ---------------

    @property
    def geometry(self) -> Geometry:
        """Where the slots sit in ``mapping()`` (segment.py)."""
        return self._segment.geometry

    def mapping(self) -> memoryview:
        """The whole segment as this process maps it (header, seals, slots),
        for a copy engine that reads slots in place (``hold_pages`` first).
        Release views of it before ``leave``."""
        self._live()
        return self._segment.buffer()

    def hold_pages(self, keys: Sequence[bytes]) -> HeldPages:
        """Where the pages of the longest sealed prefix of ``keys`` are (slot,
        generation), to be read in place and then given to
        ``release_pages``, which marks the ones read as used. Check each with
        ``seals_held`` before (all but the first ``checked``, whose seals
        were checked as they were found) and after reading it: a page that
        passes both was read as sealed. With ``pinless_reads`` (segment.py's
        ``PINLESS_READS``) that is all: pages this process found before come
        from its hints while their seals hold (hints.py), the rest from one
        index read, and a page refilled meanwhile fails its second check.
        Otherwise the pages are pinned (an index write): no member evicts or
        refills them until released."""
        self._live()
        keys = _check_keys(keys)
        if not self.pinless_reads:
            return HeldPages(self._index.pin(self.member_id, keys, mark_used=False))
        drops = self._segment.drops()
        remembered = self._hints.prefix(keys, drops)
        held = HeldPages(remembered, checked=len(remembered))
        if len(held) < len(keys):
            found = self._index.find(keys[len(held):])
            self._hints.learn(found, drops)
            held += found
        return held

    def seal_holds(self, page: Found) -> bool:
        """Whether the slot's seal still names ``page`` (its key at its
        generation): False for a torn, foreign or refilled slot."""
        return self.seals_held([page]) == 1

    def seals_held(self, pages: Sequence[Found]) -> int:
        """How many leading ``pages`` pass ``seal_holds``, checked at once."""
        self._live()
        return self._segment.seals_match([p.slot for p in pages], [p.gen for p in pages],
                                         [p.key for p in pages])

    def release_pages(self, pages: Sequence[Found], hits: int, misses: int) -> None:
        """End ``hold_pages`` (unpinning, where it pinned), counting the first
        ``hits`` pages used (marked used now, for the eviction order) and
        ``misses`` not for this member."""
        self._live()
        used = [p.slot for p in pages[:hits]]
        if self.pinless_reads:
            self._index.mark_read(self.member_id, used, hits=hits, misses=misses)
        else:
            self._index.unpin(self.member_id, [p.slot for p in pages], hits=hits,
                              misses=misses, used=used)

    def drop_page(self, page: Found, why: str) -> None:
        """Free a pinned slot whose bytes did not verify (``why``): the next
        lookup misses instead of finding it again."""
        self._live()
        logger.warning("HiCache node tier %r: the page of key %s in slot %d %s; dropped",
                       self.name, page.key.hex(), page.slot, why)
        self._hints.forget(page.key)
        self._index.drop(page, self._segment.count_drop)

    # --- publishing ------------------------------------------------------------------

    def reserve(self, count: int) -> Reserved:
        """Up to ``count`` slots to fill: free ones, else by evicting unpinned
        pages (their keys in ``evicted_keys``). Short of ``count``, dead
        members are reclaimed and the rest asked for once more; fewer than
        ``count`` means the rest is pinned or being filled."""
        self._live()
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"reserve: count must be a non-negative integer, got {count!r}")
        claimed, evicted = self._index.reserve(self.member_id, count)
        if len(claimed) < count and self.sweep():
            more, more_evicted = self._index.reserve(self.member_id, count - len(claimed))
            claimed, evicted = claimed + more, evicted + more_evicted
        for c in claimed:  # before any byte is written: unpinned readers see it
            self._segment.unseal(c.slot, c.gen)
        return Reserved([Reservation(c.slot, c.gen) for c in claimed], evicted)

    def view(self, reservation: Reservation) -> memoryview:
        """The reserved slot's ``page_bytes``, to be written in place. Release
        the view before ``leave``."""
        self._live()
        return self._segment.data(reservation.slot)

    def write(self, reservation: Reservation, data: object) -> None:
        """Copy ``data`` (a buffer of at most ``page_bytes``) into the slot."""
        self._live()
        src = memoryview(data).cast("B")  # type: ignore[arg-type]
        page_bytes = self._segment.geometry.page_bytes
        if src.nbytes > page_bytes:
            raise ValueError(f"write: {src.nbytes} bytes do not fit a page of {page_bytes}")
        self._segment.data(reservation.slot)[:src.nbytes] = src

    def seal(self, reservation: Reservation, key: bytes,
             length_bytes: int | None = None) -> bool:
        """Publish the filled slot as ``key``'s page (its first
        ``length_bytes``, default all). False when ``key`` is present already
        (the slot is given back): another member published it first."""
        self._live()
        (key,) = _check_keys([key])
        page_bytes = self._segment.geometry.page_bytes
        length = page_bytes if length_bytes is None else length_bytes
        if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= \
                page_bytes:
            raise ValueError(f"seal: length_bytes must be 1..{page_bytes}, got {length_bytes!r}")
        checksum = xxhash.xxh3_64_intdigest(self._segment.data(reservation.slot)[:length])
        # The seal goes into the segment before the index publishes the slot:
        # a reader finds the slot only once its seal is there.
        self._segment.write_seal(reservation.slot,
                                 SlotSeal(reservation.gen, length, checksum, key))
        return self._index.publish(self.member_id, Claimed(reservation.slot, reservation.gen),
                                   key)

    def abort(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be sealed."""
        self._live()
        self._index.release(self.member_id, Claimed(reservation.slot, reservation.gen))

    def clear(self) -> int:
        """Drop every sealed page no member pins (the admin API's clear);
        returns how many. Pinned pages stay: a reader is copying them."""
        self._live()
        return self._index.drop_unpinned(self._segment.count_drop)

    # --- reclaim, stats, checks ----------------------------------------------------

    def sweep(self) -> list[str]:
        """Reclaim the pins and reservations of dead members now; their ids."""
        self._live()
        return reclaim_dead(self._index, self._members_dir, self.member_id)

    def stats(self) -> NodeTierStats:
        self._live()
        g = self._segment.geometry
        counts = self._index.counts()
        return NodeTierStats(
            name=self.name, capacity_bytes=g.capacity_bytes, page_bytes=g.page_bytes,
            num_slots=g.num_slots, free_slots=counts["free"],
            reserved_slots=counts["reserved"], sealed_slots=counts["sealed"],
            pinned_slots=counts["pinned"],
            members={m.member: MemberStats(m.hits, m.misses, m.inserts, m.evictions)
                     for m in self._index.members()})

    def live_members(self) -> list[str]:
        """Members whose lease is held (this one included)."""
        self._live()
        return [m.member for m in self._index.members()
                if m.member == self.member_id
                or not probe_and_release(self._members_dir, m.member)]

    def check_integrity(self) -> list[str]:
        """What breaks the tier's invariants: the index's (index.py), and every
        sealed slot's seal against its row. [] when none; exact also while
        other members run."""
        self._live()
        problems = self._index.problems(self._segment.geometry.num_slots)
        for hit in self._index.sealed():
            if not self._seal_matches(self._segment.read_seal(hit.slot), hit):
                # Only a problem if the row still says the same: the slot may
                # have been evicted and refilled since the snapshot.
                still = self._index.find([hit.key])
                if still and still[0] == hit:
                    problems.append(f"slot {hit.slot}: seal differs from the index's key "
                                    f"{hit.key.hex()} at generation {hit.gen}")
        return problems
