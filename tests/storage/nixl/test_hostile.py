"""The nixl backend's POSIX store against someone who can change its
directory: the root symlink re-pointed after start, a fan-out directory
swapped for a symlink, a FIFO at an object's name. Real symlinks and FIFOs;
nothing may be read or written outside the store, and nothing may hang."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.storage.conformance import empty, keys, make, obj, same
from tests.storage.file.test_hostile import HANG_S, all_files, answered_within, swap_symlink

pytestmark = pytest.mark.timeout(180)


def test_root_symlink_swapped_after_start_keeps_the_checked_directory(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(mode=0o700)
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    link = tmp_path / "store"
    link.symlink_to(ours)
    b = make(("nixl", {"path": str(link)}))
    try:
        swap_symlink(link, theirs)
        ks = keys(2)
        assert b.put(ks, [obj(0), obj(1)]) == [True, True]
        target = empty()
        assert b.get(ks[1:], [target]) == [True] and same(target, obj(1))
        assert b.exists_prefix(ks) == 2
        b.clear()
        assert b.exists_prefix(ks) == 0
    finally:
        b.close()
    assert list(theirs.iterdir()) == []
    with pytest.raises(ValueError, match="writable by every user"):
        make(("nixl", {"path": str(link)}))


def test_symlinked_fanout_directory_is_not_followed(tmp_path):
    root, outside = tmp_path / "l3", tmp_path / "outside"
    b = make(("nixl", {"path": str(root)}))
    try:
        key = keys(1)[0]
        path = Path(b._store.object_path(key))
        outside.mkdir()
        (outside / key).write_bytes(obj(7)[0].tobytes() + obj(7)[1].tobytes())
        before = all_files(outside)
        path.parent.rmdir()
        path.parent.symlink_to(outside)
        assert b.exists_prefix([key]) == 0
        assert b.get([key], [empty()]) == [False]
        assert b.put([key], [obj(1)]) == [False]
        b.clear()
        assert all_files(outside) == before and sorted(outside.iterdir()) == [outside / key]
    finally:
        b.close()


def test_fifo_at_an_object_name_is_a_miss_not_a_hang(tmp_path):
    b = make(("nixl", {"path": str(tmp_path / "l3")}))
    ks = keys(3)
    assert b.put(ks[:2], [obj(0), obj(1)]) == [True, True]
    fifo = b._store.object_path(ks[1])
    os.unlink(fifo)
    os.mkfifo(fifo)
    assert answered_within(lambda: b.exists_prefix(ks))[0] == 1
    targets = [empty() for _ in ks]
    hits, elapsed = answered_within(lambda: b.get(ks, targets))
    assert hits == [True, False, False], elapsed
    assert same(targets[0], obj(0))
    assert answered_within(lambda: b.put(ks[1:2], [obj(1)]))[0] == [True]
    assert answered_within(lambda: b.get(ks[1:2], targets[1:2]))[0] == [True]
    os.unlink(fifo)
    os.mkfifo(fifo)
    answered_within(b.clear)
    assert not os.path.exists(fifo)
    _, elapsed = answered_within(b.close)
    assert elapsed < HANG_S
