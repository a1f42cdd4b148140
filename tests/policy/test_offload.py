"""Backup backpressure (policy/offload.py): the in-flight bound and the backlog."""

from __future__ import annotations

from vllm_hicache.policy.offload import (
    MAX_INFLIGHT_BACKUP_PAGES,
    MIN_INFLIGHT_BACKUP_PAGES,
    BackupBacklog,
    backup_inflight_cap,
)


def chain(name: str, n: int) -> tuple[bytes, ...]:
    return tuple(f"{name}{i}".encode() for i in range(n))


def taken(entries) -> list[tuple[bytes, ...]]:
    """The hashes of what ``take`` handed out, entry by entry."""
    return [tuple(e.chain[b] for b in e.blocks) for e in entries]


def test_inflight_cap_is_a_quarter_of_the_prefetch_cap_within_bounds():
    assert backup_inflight_cap(10) == MIN_INFLIGHT_BACKUP_PAGES
    assert backup_inflight_cap(4000) == 1000
    assert backup_inflight_cap(10**8) == MAX_INFLIGHT_BACKUP_PAGES


def test_prefixes_leave_before_extensions_and_newer_before_older():
    q = BackupBacklog(100)
    a = chain("a", 8)
    q.defer(a, [4, 5, 6, 7])     # an extension of a
    q.defer(a, [0, 1, 2, 3])     # a's prefix
    b = chain("b", 4)
    q.defer(b, [0, 1])           # another prefix, newer
    out = taken(q.take(100))
    assert out == [b[0:2], a[0:4], a[4:8]]
    assert len(q) == 0 and q.num_blocks == 0


def test_used_blocks_leave_first():
    q = BackupBacklog(100)
    a, b = chain("a", 4), chain("b", 4)
    q.defer(a, [0, 1, 2, 3])
    q.defer(b, [0, 1, 2, 3])
    q.record_use(a[:2])          # a request hit a's first blocks
    assert taken(q.take(4)) == [a]


def test_take_splits_an_entry_prefix_first():
    q = BackupBacklog(100)
    a = chain("a", 6)
    q.defer(a, range(6))
    first = q.take(4)
    assert taken(first) == [a[:4]] and first[0].chain == a[:4]
    assert q.num_blocks == 2
    assert taken(q.take(10)) == [a[4:]]


def test_a_full_backlog_cuts_the_least_valuable_tail():
    q = BackupBacklog(max_blocks=5)
    a, b = chain("a", 4), chain("b", 4)
    assert q.defer(a, range(4)) == 0
    q.record_use(a)
    assert q.defer(b, range(4)) == 3   # b is worth less: its last 3 blocks go
    assert q.num_blocks == 5
    assert taken(q.take(10)) == [a, b[:1]]


def test_entry_bound_drops_whole_entries():
    q = BackupBacklog(max_blocks=100, max_entries=2)
    for name in "abc":
        q.defer(chain(name, 2), [0, 1])
    assert len(q) == 2 and q.num_blocks == 4
    assert taken(q.take(10)) == [chain("c", 2), chain("b", 2)]


def test_a_block_is_queued_once():
    q = BackupBacklog(100)
    a = chain("a", 4)
    q.defer(a, [0, 1])
    assert q.defer(a, [1, 2]) == 0
    assert q.num_blocks == 3
    assert sorted(h for e in taken(q.take(10)) for h in e) == sorted(a[:3])


def test_many_uses_keep_the_heaps_small_and_the_order_right():
    q = BackupBacklog(1000)
    chains = [chain(f"c{i}-", 2) for i in range(10)]
    for c in chains:
        q.defer(c, [0, 1])
    for _ in range(500):
        q.record_use(chains[3])
    q.take(0)  # compacts
    assert len(q._best) + len(q._worst) < 100
    assert taken(q.take(2)) == [chains[3]]


def test_clear_returns_what_was_dropped():
    q = BackupBacklog(100)
    q.defer(chain("a", 3), range(3))
    assert q.clear() == 3 and len(q) == 0 and q.num_blocks == 0
    q.record_use(chain("a", 3))  # nothing left to bump
