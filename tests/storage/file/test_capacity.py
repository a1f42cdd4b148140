"""``file`` backend with ``max_bytes``: LRU eviction of whole objects, objects
that cannot fit, recounting after a restart, stale temp files. (The
two-process stress with a capacity is in test_backend.py.)"""

from __future__ import annotations

import os
from pathlib import Path

from tests.storage.conformance import OBJECT_BYTES, empty, keys, obj
from tests.storage.file.fixtures import build, object_files, root, spec  # noqa: F401
from vllm_hicache.storage.file import io as file_io


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in object_files(root))


def test_lru_eviction_keeps_recently_read(build, root):
    b = build(max_bytes=3 * OBJECT_BYTES)
    ks = keys(5)
    assert b.put(ks[:3], [obj(i) for i in range(3)]) == [True] * 3
    assert b.get([ks[0]], [empty()]) == [True]  # ks[1] is now least recently used
    assert b.put([ks[3]], [obj(3)]) == [True]
    assert [b.exists_prefix([k]) for k in ks[:4]] == [1, 0, 1, 1]
    assert b.get([ks[1]], [empty()]) == [False]
    assert b.put([ks[4]], [obj(4)]) == [True]  # evicts ks[2]
    assert [b.exists_prefix([k]) for k in ks] == [1, 0, 0, 1, 1]
    assert stored_bytes(root) <= 3 * OBJECT_BYTES and b.stats()["evictions"] == 2


def test_batch_larger_than_capacity_keeps_its_head(build, root):
    b = build(max_bytes=2 * OBJECT_BYTES)
    ks = keys(4)
    assert b.put(ks, [obj(i) for i in range(4)]) == [True, True, False, False]
    assert b.exists_prefix(ks) == 2 and stored_bytes(root) == 2 * OBJECT_BYTES
    assert list(root.glob("*/*/.*.tmp")) == []


def test_object_that_cannot_fit_is_refused(build, root):
    b = build(max_bytes=OBJECT_BYTES - 1)
    ks = keys(1)
    assert b.put(ks, [obj(0)]) == [False]
    assert b.exists_prefix(ks) == 0 and object_files(root) == []


def test_new_process_evicts_oldest_by_mtime(build, root):
    first = build(max_bytes=3 * OBJECT_BYTES)
    ks = keys(4)
    first.put(ks[:3], [obj(i) for i in range(3)])
    first.close()
    for age, key in zip((100, 300, 200), ks[:3]):  # ks[1] is the oldest
        os.utime(file_io.object_path(str(root), key), (1e9 - age, 1e9 - age))
    second = build(max_bytes=3 * OBJECT_BYTES)  # empty index: must rescan to find victims
    assert second.put([ks[3]], [obj(3)]) == [True]
    assert [second.exists_prefix([k]) for k in ks] == [1, 0, 1, 1]


def test_overwrite_does_not_double_count(build):
    b = build(max_bytes=2 * OBJECT_BYTES)
    ks = keys(2)
    for _ in range(5):
        assert b.put(ks, [obj(0), obj(1)]) == [True, True]
    assert b.exists_prefix(ks) == 2 and b.stats()["evictions"] == 0
    assert b.stats()["usage_bytes"] == 2 * OBJECT_BYTES


def test_rescan_removes_stale_temp_files(build, root):
    b = build(max_bytes=2 * OBJECT_BYTES)
    key = keys(1)[0]
    leaf = Path(file_io.object_path(str(root), key)).parent
    leaf.mkdir(parents=True)
    stale, fresh = leaf / f".{key}.{'0' * 16}.tmp", leaf / f".{key}.{'1' * 16}.tmp"
    for tmp in (stale, fresh):
        tmp.write_bytes(b"partial")
    os.utime(stale, (1e9, 1e9))
    assert b.put(keys(3), [obj(i) for i in range(3)]) == [True, True, False]  # rescans
    assert not stale.exists() and fresh.exists()


def test_evicted_keys_are_told_exactly_once_and_not_once_back(build, root):
    """For exact KV events: the keys the LRU unlinked, each once; a key
    committed again before it is taken is back in the store: not told."""
    b = build(max_bytes=2 * OBJECT_BYTES)
    ks = keys(4)
    assert b.put(ks[:2], [obj(0), obj(1)]) == [True, True]
    assert b.take_removed_keys() == []
    assert b.put([ks[2]], [obj(2)]) == [True]        # evicts ks[0]
    assert b.put([ks[3]], [obj(3)]) == [True]        # evicts ks[1]
    assert b.put([ks[0]], [obj(0)]) == [True]        # ks[0] back; evicts ks[2]
    told = b.take_removed_keys()
    assert told == [ks[1], ks[2]]
    assert all(b.exists_prefix([k]) == 0 for k in told)  # really gone
    assert b.take_removed_keys() == []
