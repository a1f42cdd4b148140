"""``NodeTier``: one process's membership of a node tier (the package
docstring gives the design; segment.py, index.py and lease.py the formats).

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

import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from vllm_hicache.node.errors import NodeTierError
from vllm_hicache.node.index import EVICTION_POLICIES, Claimed, Found, Index
from vllm_hicache.node.lease import (
    Lease,
    live_leases,
    new_member_id,
    orphan_files,
    probe,
    remove_unfinished,
)
from vllm_hicache.node.segment import KEY_MAX_BYTES, Geometry, Segment, SlotSeal

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_READY = "ready"


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


def tier_directory(root: str, name: str, identity: str) -> str:
    """Where the tier of ``name`` for ``identity`` lives: tiers of different
    identities never share a directory."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return os.path.join(root, f"hicache-node-{name}-{digest}")


def check_name(name: object) -> str:
    """``name`` if it can name a tier (it becomes part of a directory name),
    else ValueError saying what is accepted."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"node tier name {name!r}: 1 to 64 letters, digits, '_', '.' or "
                         "'-', starting with a letter or digit")
    return name


def _check_join_args(name: str, identity: str, capacity_bytes: int, page_bytes: int,
                     root: str, eviction: str, lock_timeout_s: float,
                     sweep_interval_s: float) -> None:
    check_name(name)
    if not isinstance(identity, str) or not identity:
        raise ValueError("node tier identity must be a non-empty string (the key namespace "
                         "of the KV bytes, e.g. KeyNamespace.tag)")
    for what, value in (("capacity_bytes", capacity_bytes), ("page_bytes", page_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"node tier {what} must be a positive integer, got {value!r}")
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f"node tier eviction {eviction!r}: one of {', '.join(EVICTION_POLICIES)}")
    for what, seconds in (("lock_timeout_s", lock_timeout_s),
                          ("sweep_interval_s", sweep_interval_s)):
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"node tier {what} must be a positive number, got {seconds!r}")
    if not os.path.isdir(root):
        raise NodeTierError(f"node tier root {root} is not a directory (a tmpfs such as "
                            "/dev/shm is expected)")


def _differences(settings: dict[str, object], segment: Segment, digest: bytes,
                 wanted: dict[str, object]) -> list[str]:
    """How an existing tier differs from what a joiner asks for."""
    out = []
    if settings.get("identity_sha256") != digest.hex() or segment.identity_digest != digest:
        out.append("it holds another identity's pages (a tier directory name collision)")
    if settings.get("epoch") != segment.epoch.hex():
        out.append("its index and its segment come from different creations")
    for what, value in wanted.items():
        if settings.get(what) != value:
            out.append(f"{what} is {settings.get(what)!r} there, {value!r} here")
    return out


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

    def __init__(self, name: str, directory: str, segment: Segment, index: Index,
                 lease: Lease, member_id: str, lock_timeout_s: float,
                 sweep_interval_s: float) -> None:
        self.name = name
        self.directory = directory
        self.member_id = member_id
        self._segment = segment
        self._index = index
        self._lease = lease
        self._members_dir = os.path.join(directory, "members")
        self._lock_timeout_s = lock_timeout_s
        self._pid = os.getpid()
        self._left = False
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, args=(sweep_interval_s,),
                                         name=f"hicache-node-sweep-{name}", daemon=True)
        self._sweeper.start()

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
        _check_join_args(name, identity, capacity_bytes, page_bytes, root, eviction,
                         lock_timeout_s, sweep_interval_s)
        directory = tier_directory(root, name, identity)
        digest = hashlib.sha256(identity.encode()).digest()
        # Before anything is touched: a size that holds no page changes nothing.
        geometry = Geometry.for_capacity(capacity_bytes, page_bytes)
        member_id = new_member_id()
        # Creation, replacement and the first steps of membership are
        # serialised per tier by a flock the kernel drops if its holder dies.
        lock_fd = os.open(os.path.join(root, f".{os.path.basename(directory)}.lock"),
                          os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            segment, index = cls._open_or_create(directory, digest, geometry, eviction,
                                                 lock_timeout_s)
            try:
                lease = Lease.acquire(os.path.join(directory, "members"), member_id)
                index.add_member(member_id, os.getpid())
            except BaseException:
                index.close()
                segment.close()
                raise
        finally:
            os.close(lock_fd)
        logger.info("HiCache node tier %r: joined %s as %s (%d slots of %d bytes)", name,
                    directory, member_id, segment.geometry.num_slots, page_bytes)
        return cls(name, directory, segment, index, lease, member_id, lock_timeout_s,
                   sweep_interval_s)

    @classmethod
    def _open_or_create(cls, directory: str, digest: bytes, geometry: Geometry, eviction: str,
                        lock_timeout_s: float) -> tuple[Segment, Index]:
        members_dir = os.path.join(directory, "members")
        wanted: dict[str, object] = {"capacity_bytes": geometry.capacity_bytes,
                                     "page_bytes": geometry.page_bytes, "eviction": eviction}
        if os.path.exists(os.path.join(directory, _READY)):
            opened = cls._open(directory, digest, wanted, lock_timeout_s)
            if isinstance(opened, tuple):
                return opened
            live = live_leases(members_dir)
            if live:
                raise NodeTierError(
                    f"node tier at {directory} is in use by {live} live member(s) and "
                    f"{opened}. Every instance sharing a node tier must configure the same "
                    "size, page size and eviction policy (or use another tier name)")
            logger.warning("HiCache node tier at %s: no live member and %s: replacing it "
                           "(its pages are dropped)", directory, opened)
        if os.path.exists(directory):
            shutil.rmtree(directory)  # a replaced tier, or a creation that died halfway
        os.makedirs(members_dir)
        epoch = secrets.token_bytes(16)
        try:
            segment = Segment.create(os.path.join(directory, "pages"), geometry, digest, epoch)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        index = Index(os.path.join(directory, "index.sqlite"), lock_timeout_s)
        index.create(geometry.num_slots, {
            "identity_sha256": digest.hex(), "epoch": epoch.hex(),
            "capacity_bytes": geometry.capacity_bytes, "page_bytes": geometry.page_bytes,
            "num_slots": geometry.num_slots}, eviction)
        # Written last: a directory without it is a creation that died.
        ready = os.path.join(directory, f".{_READY}")
        with open(ready, "w") as f:
            f.write(epoch.hex() + "\n")
        os.rename(ready, os.path.join(directory, _READY))
        return segment, index

    @classmethod
    def _open(cls, directory: str, digest: bytes, wanted: dict[str, object],
              lock_timeout_s: float) -> tuple[Segment, Index] | str:
        """The existing tier, or why it cannot be used as it is."""
        try:
            segment = Segment.attach(os.path.join(directory, "pages"))
        except (OSError, NodeTierError) as e:
            return f"its segment is damaged ({e})"
        index = Index(os.path.join(directory, "index.sqlite"), lock_timeout_s)
        try:
            settings = index.settings()
        except NodeTierError as e:
            index.close()
            segment.close()
            return f"its index is damaged ({e})"
        differs = _differences(settings, segment, digest, wanted)
        if differs:
            index.close()
            segment.close()
            return "it differs from what this process asks for: " + "; ".join(differs)
        index.use_policy(str(settings["eviction"]))
        _reclaim_dead(index, os.path.join(directory, "members"), None)
        remove_unfinished(os.path.join(directory, "members"))  # we hold the creation lock
        return segment, index

    def leave(self) -> None:
        """Stop sweeping, drop this member's pins and reservations, release the
        lease. Its sealed pages stay for the other and later members.
        Idempotent."""
        if self._left:
            return
        self._left = True
        self._stop.set()
        if threading.current_thread() is not self._sweeper:
            self._sweeper.join()
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
            self._index.drop(bad)
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
        for a copy engine that reads slots in place (``pin_pages`` first).
        Release views of it before ``leave``."""
        self._live()
        return self._segment.buffer()

    def pin_pages(self, keys: Sequence[bytes]) -> list[Found]:
        """Pin the longest sealed prefix of ``keys`` and say where each page
        is (slot, generation): no member evicts or refills these slots until
        ``release_pages``, which marks the ones read as used. Check each with
        ``seal_holds`` before and after reading it in place."""
        self._live()
        return self._index.pin(self.member_id, _check_keys(keys), mark_used=False)

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
        """Undo ``pin_pages``, counting the first ``hits`` pages used (marked
        used now, for the eviction order) and ``misses`` not for this member."""
        self._live()
        self._index.unpin(self.member_id, [p.slot for p in pages], hits=hits, misses=misses,
                          used=[p.slot for p in pages[:hits]])

    def drop_page(self, page: Found, why: str) -> None:
        """Free a pinned slot whose bytes did not verify (``why``): the next
        lookup misses instead of finding it again."""
        self._live()
        logger.warning("HiCache node tier %r: the page of key %s in slot %d %s; dropped",
                       self.name, page.key.hex(), page.slot, why)
        self._index.drop(page)

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
        return self._index.drop_unpinned()

    # --- reclaim, stats, checks ----------------------------------------------------

    def sweep(self) -> list[str]:
        """Reclaim the pins and reservations of dead members now; their ids."""
        self._live()
        return _reclaim_dead(self._index, self._members_dir, self.member_id)

    def _sweep_loop(self, interval_s: float) -> None:
        index: Index | None = None
        try:
            while not self._stop.wait(interval_s):
                try:
                    index = index or Index(os.path.join(self.directory, "index.sqlite"),
                                           self._lock_timeout_s)
                    _reclaim_dead(index, self._members_dir, self.member_id)
                except (NodeTierError, OSError) as e:
                    logger.warning("HiCache node tier %r: sweep failed (%s); retrying in "
                                   "%.1f s", self.name, e, interval_s)
        finally:
            if index is not None:
                index.close()

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
                or not _probe_and_release(self._members_dir, m.member)]

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


def _probe_and_release(members_dir: str, member: str) -> bool:
    """Whether ``member`` is dead, leaving its lease file as it was."""
    found = probe(members_dir, member)
    found.let_go()
    return found.dead


def _reclaim_dead(index: Index, members_dir: str, me: str | None) -> list[str]:
    """Remove every dead member from ``index`` (its pins and reservations
    with it), then the lease files of no member; returns the removed ids."""
    gone: list[str] = []
    rows = index.members()
    for row in rows:
        if row.member == me:
            continue
        found = probe(members_dir, row.member)
        if not found.dead:
            continue
        try:
            freed = index.remove_member(row.member)
        finally:
            found.finish()
        gone.append(row.member)
        logger.info("HiCache node tier: reclaimed dead member %s (%d reservations, %d pins)",
                    row.member, freed.reservations, freed.pins)
    orphan_files(members_dir, {row.member for row in rows})
    return gone
