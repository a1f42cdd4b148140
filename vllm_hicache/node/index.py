"""The node tier's cross-process index: SQLite in WAL mode, a file beside the
segment in the same tmpfs.

Tables:
    meta(name, value)         the tier's settings and the creation epoch
    slots(slot, state, key, owner, gen, last_access_ns, uses)
                              one row per slot, always all of them: FREE
                              (key and owner NULL), RESERVED (owner = the
                              member filling it, key NULL) or SEALED (key
                              set, unique); ``gen`` grows on every reserve
                              and free, so a seal names one filling
    pins(member, slot, count) who holds which sealed slot against eviction
    members(member, pid, joined_ns, hits, misses, inserts, evictions)

Why SQLite: every change is one transaction, and a member killed inside it
(SIGKILL at any instruction) leaves the index as it was before the
transaction: the next writer's WAL recovery drops the torn frames. Its
locks are fcntl locks, which the kernel releases when their holder dies, so
no member can block the others beyond its own transaction. That gives
crash-atomic multi-row changes (reserve + evict, seal, reclaim) without a
hand-written journal; writes are serialised (tens of thousands of small
transactions a second on tmpfs), reads run beside the writer. Batches
(``lookup``, ``pin`` and ``read`` of many keys) are one statement or one
transaction each.

SQLite's own hazard: a process that opens and closes the database file by
any other means drops SQLite's locks on it; nothing here does.

Time: ``last_access_ns`` is CLOCK_MONOTONIC, one clock for every process on
the host.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from vllm_hicache.node.errors import NodeTierError

FREE, RESERVED, SEALED = 0, 1, 2
EVICTION_POLICIES = ("lru", "lfu")
# SQLite's bound on one statement's parameters is 32766; stay far below.
_BATCH = 500
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE meta(name TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE slots(
    slot INTEGER PRIMARY KEY,
    state INTEGER NOT NULL,
    key BLOB UNIQUE,
    owner TEXT,
    gen INTEGER NOT NULL,
    last_access_ns INTEGER NOT NULL DEFAULT 0,
    uses INTEGER NOT NULL DEFAULT 0);
CREATE INDEX slots_free ON slots(state) WHERE state = 0;
CREATE INDEX slots_owner ON slots(owner) WHERE owner IS NOT NULL;
CREATE TABLE pins(member TEXT, slot INTEGER, count INTEGER NOT NULL,
                  PRIMARY KEY(member, slot)) WITHOUT ROWID;
CREATE INDEX pins_slot ON pins(slot);
CREATE TABLE members(member TEXT PRIMARY KEY, pid INTEGER NOT NULL,
    joined_ns INTEGER NOT NULL, hits INTEGER NOT NULL DEFAULT 0,
    misses INTEGER NOT NULL DEFAULT 0, inserts INTEGER NOT NULL DEFAULT 0,
    evictions INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
"""
# The eviction order of each policy, with the index that serves it.
_VICTIM_ORDER = {"lru": "last_access_ns", "lfu": "uses, last_access_ns"}
_VICTIM_INDEX = {
    "lru": "CREATE INDEX slots_lru ON slots(last_access_ns) WHERE state = 2",
    "lfu": "CREATE INDEX slots_lfu ON slots(uses, last_access_ns) WHERE state = 2",
}


@dataclass(frozen=True)
class Claimed:
    """A slot handed to a member to fill, at generation ``gen``."""

    slot: int
    gen: int


class Found(NamedTuple):
    """A sealed slot as the index knows it (a NamedTuple: a load makes one
    per page, on the forward's path)."""

    key: bytes
    slot: int
    gen: int


@dataclass
class MemberRow:
    member: str
    pid: int
    hits: int
    misses: int
    inserts: int
    evictions: int


@dataclass
class Reclaimed:
    """What a dead member held: reservations freed, pins dropped."""

    reservations: int
    pins: int


def _chunks(seq: Sequence[T]) -> Iterator[Sequence[T]]:
    for i in range(0, len(seq), _BATCH):
        yield seq[i:i + _BATCH]


def _marks(chunk: Sequence[object]) -> str:
    """The placeholders of an ``IN (...)`` list of ``chunk``."""
    return ",".join("?" * len(chunk))


def _distinct(slots: Sequence[int]) -> bool:
    """Whether no slot is listed twice: then one ``IN`` statement does what a
    statement per slot would."""
    return len(set(slots)) == len(slots)


class Index:
    """One connection to the index, shared by this process's threads: one
    lock serialises them (a transaction, or a lone statement, at a time)."""

    def __init__(self, path: str, lock_timeout_s: float) -> None:
        self.path = path
        self.lock_timeout_s = lock_timeout_s
        # isolation_level=None: transactions are spelled out (BEGIN IMMEDIATE).
        self._db = sqlite3.connect(path, timeout=lock_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._lock = threading.RLock()
        self._db.execute("PRAGMA synchronous=NORMAL")  # tmpfs: durability is moot
        self.policy = "lru"
        self._victim_order = _VICTIM_ORDER["lru"]

    # --- creation ------------------------------------------------------------

    def create(self, num_slots: int, settings: dict[str, object], policy: str) -> None:
        """Lay out a new index: every slot FREE at generation 0."""
        self._db.execute("PRAGMA journal_mode=WAL")
        with self.write() as db:
            for statement in (_SCHEMA + _VICTIM_INDEX[policy]).split(";"):
                if statement.strip():
                    db.execute(statement)
            db.executemany("INSERT INTO meta VALUES (?, ?)",
                           [*settings.items(), ("eviction", policy)])
            db.executemany("INSERT INTO slots(slot, state, gen) VALUES (?, 0, 0)",
                           ((i,) for i in range(num_slots)))
        self.use_policy(policy)

    def settings(self) -> dict[str, object]:
        try:
            with self._lock:
                return dict(self._db.execute("SELECT name, value FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise NodeTierError(f"node tier index {self.path} is unreadable: {e}") from e

    def use_policy(self, policy: str) -> None:
        self.policy = policy
        self._victim_order = _VICTIM_ORDER[policy]

    # --- transactions --------------------------------------------------------

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it or (on an exception, or the death
        of this process) none of it."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise NodeTierError(
                    f"node tier index {self.path}: no write lock within {self.lock_timeout_s} "
                    f"s ({e}); a live member is holding a transaction open") from e
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # --- members ---------------------------------------------------------------

    def add_member(self, member: str, pid: int) -> None:
        with self.write() as db:
            db.execute("INSERT INTO members(member, pid, joined_ns) VALUES (?, ?, ?)",
                       (member, pid, time.monotonic_ns()))

    def members(self) -> list[MemberRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT member, pid, hits, misses, inserts, evictions FROM members").fetchall()
        return [MemberRow(*row) for row in rows]

    def remove_member(self, member: str) -> Reclaimed:
        """Drop ``member`` with its pins and reservations (leave, or reclaim
        after its death)."""
        with self.write() as db:
            pins = db.execute("SELECT COALESCE(SUM(count), 0) FROM pins WHERE member = ?",
                              (member,)).fetchone()[0]
            db.execute("DELETE FROM pins WHERE member = ?", (member,))
            freed = db.execute(
                "UPDATE slots SET state = 0, owner = NULL, key = NULL, gen = gen + 1 "
                "WHERE owner = ? AND state = 1", (member,)).rowcount
            db.execute("DELETE FROM members WHERE member = ?", (member,))
        return Reclaimed(freed, pins)

    # --- lookups -------------------------------------------------------------------

    def find(self, keys: Sequence[bytes], db: sqlite3.Connection | None = None) -> list[Found]:
        """The sealed slots of the longest prefix of ``keys`` present."""
        db = db or self._db
        found: list[Found] = []
        for chunk in _chunks(keys):
            with self._lock:
                rows = db.execute(
                    f"SELECT key, slot, gen FROM slots WHERE state = 2 AND key IN "
                    f"({','.join('?' * len(chunk))})", list(chunk)).fetchall()
            where = {k: (s, g) for k, s, g in rows}  # a BLOB comes back as bytes
            for key in chunk:
                hit = where.get(key)
                if hit is None:
                    return found
                found.append(Found(key, *hit))
        return found

    def pin(self, member: str, keys: Sequence[bytes], mark_used: bool = True) -> list[Found]:
        """Pin the longest sealed prefix of ``keys`` for ``member`` (counted:
        pinned twice, unpinned twice) and, with ``mark_used``, mark it used
        now (else the unpin marks what was used)."""
        with self.write() as db:
            found = self.find(keys, db)
            slots = [f.slot for f in found]
            if _distinct(slots):  # one statement per chunk, not one per row
                for chunk in _chunks(slots):
                    db.execute(
                        "INSERT INTO pins SELECT ?, slot, 1 FROM slots WHERE slot IN "
                        f"({_marks(chunk)}) ON CONFLICT(member, slot) DO UPDATE SET "
                        "count = count + 1", [member, *chunk])
            else:  # a slot listed twice is pinned twice
                db.executemany(
                    "INSERT INTO pins VALUES (?, ?, 1) "
                    "ON CONFLICT(member, slot) DO UPDATE SET count = count + 1",
                    ((member, slot) for slot in slots))
            if mark_used:
                self._mark_used(db, slots)
        return found

    @staticmethod
    def _mark_used(db: sqlite3.Connection, slots: Sequence[int]) -> None:
        now = time.monotonic_ns()
        if _distinct(slots):
            for chunk in _chunks(slots):
                db.execute("UPDATE slots SET last_access_ns = ?, uses = uses + 1 "
                           f"WHERE slot IN ({_marks(chunk)})", [now, *chunk])
        else:
            db.executemany("UPDATE slots SET last_access_ns = ?, uses = uses + 1 "
                           "WHERE slot = ?", ((now, slot) for slot in slots))

    def mark_read(self, member: str, used: Sequence[int], hits: int, misses: int) -> None:
        """Mark the ``used`` slots used now and count ``hits``/``misses`` for
        ``member`` (a read that held no pins)."""
        with self.write() as db:
            self._mark_read(db, member, used, hits, misses)

    def _mark_read(self, db: sqlite3.Connection, member: str, used: Sequence[int],
                   hits: int, misses: int) -> None:
        self._mark_used(db, used)
        if hits or misses:
            db.execute("UPDATE members SET hits = hits + ?, misses = misses + ? "
                       "WHERE member = ?", (hits, misses, member))

    def unpin(self, member: str, slots: Sequence[int],
              hits: int = 0, misses: int = 0, used: Sequence[int] = ()) -> None:
        """Drop one pin of ``member`` on each slot (a slot it does not pin is
        ignored), counting ``hits``/``misses`` for it; mark the ``used``
        slots used now."""
        with self.write() as db:
            self._mark_read(db, member, used, hits, misses)
            if _distinct(slots):
                for chunk in _chunks(slots):
                    db.execute("UPDATE pins SET count = count - 1 WHERE member = ? AND slot IN "
                               f"({_marks(chunk)})", [member, *chunk])
            else:  # a slot listed twice loses two pins
                db.executemany("UPDATE pins SET count = count - 1 WHERE member = ? AND "
                               "slot = ?", ((member, s) for s in slots))
            db.execute("DELETE FROM pins WHERE member = ? AND count <= 0", (member,))

    def pinned_slots(self, member: str, keys: Sequence[bytes]) -> list[int]:
        """``member``'s pinned slots among ``keys``."""
        slots: list[int] = []
        for chunk in _chunks(keys):
            with self._lock:
                slots += [s for (s,) in self._db.execute(
                    "SELECT p.slot FROM pins p JOIN slots s ON s.slot = p.slot WHERE "
                    f"p.member = ? AND s.key IN ({','.join('?' * len(chunk))})",
                    [member, *chunk])]
        return slots

    # --- filling slots -------------------------------------------------------------

    def reserve(self, member: str, count: int) -> tuple[list[Claimed], list[bytes]]:
        """Up to ``count`` slots for ``member`` to fill: free ones first, then
        the unpinned sealed slots the policy ranks first, whose keys are
        returned as evicted."""
        with self.write() as db:
            slots = [s for (s,) in db.execute(
                "SELECT slot FROM slots WHERE state = 0 LIMIT ?", (count,))]
            evicted: list[bytes] = []
            if len(slots) < count:
                victims = db.execute(
                    "SELECT slot, key FROM slots WHERE state = 2 AND NOT EXISTS "
                    "(SELECT 1 FROM pins WHERE pins.slot = slots.slot) "
                    f"ORDER BY {self._victim_order} LIMIT ?", (count - len(slots),)).fetchall()
                slots += [s for s, _ in victims]
                evicted = [bytes(k) for _, k in victims]
                db.execute("UPDATE members SET evictions = evictions + ? WHERE member = ?",
                           (len(evicted), member))
            claimed = [Claimed(s, db.execute(
                "UPDATE slots SET state = 1, owner = ?, key = NULL, gen = gen + 1, uses = 0 "
                "WHERE slot = ? RETURNING gen", (member, s)).fetchone()[0]) for s in slots]
        return claimed, evicted

    def publish(self, member: str, claimed: Claimed, key: bytes) -> bool:
        """Make ``member``'s filled slot the sealed page of ``key``. False (and
        the slot freed) when ``key`` is already sealed elsewhere, or the
        reservation is no longer ``member``'s at that generation."""
        with self.write() as db:
            mine = db.execute("SELECT 1 FROM slots WHERE slot = ? AND gen = ? AND state = 1 "
                              "AND owner = ?", (claimed.slot, claimed.gen, member)).fetchone()
            if mine is None:
                return False
            taken = db.execute("SELECT 1 FROM slots WHERE key = ?", (key,)).fetchone()
            if taken is not None:
                self._free(db, claimed.slot)
                return False
            db.execute("UPDATE slots SET state = 2, owner = NULL, key = ?, last_access_ns = ? "
                       "WHERE slot = ?", (key, time.monotonic_ns(), claimed.slot))
            db.execute("UPDATE members SET inserts = inserts + 1 WHERE member = ?", (member,))
        return True

    def release(self, member: str, claimed: Claimed) -> None:
        """Give back a reservation that will not be sealed."""
        with self.write() as db:
            db.execute("UPDATE slots SET state = 0, owner = NULL, key = NULL, gen = gen + 1 "
                       "WHERE slot = ? AND gen = ? AND owner = ? AND state = 1",
                       (claimed.slot, claimed.gen, member))

    def drop(self, found: Found, freed: Callable[[], None]) -> None:
        """Free a sealed slot whose seal did not verify, if it still holds that
        generation (an unpinned reader's slot may have been refilled since);
        its pins go with it, the reader's own included. ``freed`` runs inside
        the transaction when a slot was freed."""
        with self.write() as db:
            if db.execute("UPDATE slots SET state = 0, key = NULL, owner = NULL, "
                          "gen = gen + 1 WHERE slot = ? AND gen = ? AND state = 2",
                          (found.slot, found.gen)).rowcount:
                db.execute("DELETE FROM pins WHERE slot = ?", (found.slot,))
                freed()

    def drop_unpinned(self, freed: Callable[[], None]) -> int:
        """Free every sealed slot without a pin; how many were freed.
        ``freed`` runs inside the transaction when any was."""
        with self.write() as db:
            count = db.execute("UPDATE slots SET state = 0, key = NULL, owner = NULL, "
                               "gen = gen + 1 WHERE state = 2 AND slot NOT IN "
                               "(SELECT slot FROM pins)").rowcount
            if count:
                freed()
            return count

    @staticmethod
    def _free(db: sqlite3.Connection, slot: int) -> None:
        db.execute("UPDATE slots SET state = 0, owner = NULL, key = NULL, gen = gen + 1 "
                   "WHERE slot = ?", (slot,))

    # --- accounting ------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Slots per state, pinned slots, and all slot rows (one snapshot)."""
        with self.read() as db:
            states = dict(db.execute("SELECT state, COUNT(*) FROM slots GROUP BY state"))
            pinned = db.execute("SELECT COUNT(DISTINCT slot) FROM pins").fetchone()[0]
        return {"free": states.get(FREE, 0), "reserved": states.get(RESERVED, 0),
                "sealed": states.get(SEALED, 0), "pinned": pinned,
                "rows": sum(states.values())}

    def sealed(self) -> list[Found]:
        with self._lock:
            return [Found(bytes(k), s, g) for k, s, g in self._db.execute(
                "SELECT key, slot, gen FROM slots WHERE state = 2")]

    def problems(self, num_slots: int) -> list[str]:
        """What breaks the index's invariants (module docstring), read in one
        snapshot; [] when none."""
        out: list[str] = []
        with self.read() as db:
            q = db.execute
            rows, low, high = q("SELECT COUNT(*), MIN(slot), MAX(slot) FROM slots").fetchone()
            if (rows, low, high) != (num_slots, 0, num_slots - 1):
                out.append(f"slot rows {rows} ({low}..{high}), expected 0..{num_slots - 1}")
            checks = {
                "free slots with a key or owner":
                    "SELECT COUNT(*) FROM slots WHERE state = 0 "
                    "AND (key IS NOT NULL OR owner IS NOT NULL)",
                "reserved slots with a key or no owner":
                    "SELECT COUNT(*) FROM slots WHERE state = 1 AND (key IS NOT NULL OR owner "
                    "IS NULL)",
                "sealed slots without a key or with an owner":
                    "SELECT COUNT(*) FROM slots WHERE state = 2 AND (key IS NULL OR owner "
                    "IS NOT NULL)",
                "slots in no known state": "SELECT COUNT(*) FROM slots WHERE state NOT IN "
                                           "(0, 1, 2)",
                "reservations of no member":
                    "SELECT COUNT(*) FROM slots WHERE state = 1 AND owner NOT IN "
                    "(SELECT member FROM members)",
                "pins of no member":
                    "SELECT COUNT(*) FROM pins WHERE member NOT IN (SELECT member FROM members)",
                "pins on slots that are not sealed":
                    "SELECT COUNT(*) FROM pins p JOIN slots s ON s.slot = p.slot "
                    "WHERE s.state != 2",
                "pins with a count below one": "SELECT COUNT(*) FROM pins WHERE count < 1",
            }
            for what, sql in checks.items():
                n = q(sql).fetchone()[0]
                if n:
                    out.append(f"{n} {what}")
        return out

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read snapshot (several statements seeing the same state)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()
