"""The ``file`` backend's permissions: what it creates is owner-only unless
``file_mode``/``dir_mode`` say otherwise, whatever the umask, and a store
directory that others can write to is refused unless ``allow_shared_dir``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.storage.conformance import keys, make, obj
from vllm_hicache.storage.file import io as file_io


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def created_paths(root: Path) -> tuple[list[Path], list[Path]]:
    """(directories, files) under ``root``, root included."""
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    return dirs, files


@pytest.fixture
def umask():
    """``umask(mask)`` for this test, restored after."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o000, 0o077])
@pytest.mark.parametrize("options, file_mode, dir_mode", [
    ({}, 0o600, 0o700),
    ({"file_mode": "0660", "dir_mode": "0770"}, 0o660, 0o770),  # a group-shared store
    ({"file_mode": "0o640", "dir_mode": 0o750}, 0o640, 0o750),
])
def test_created_paths_have_exactly_the_modes(tmp_path, umask, mask, options, file_mode,
                                              dir_mode):
    umask(mask)
    root = tmp_path / "store" / "l3"
    b = make(("file", {"path": str(root), "max_bytes": 1 << 20, **options}))
    try:
        ks = keys(20)
        assert b.put(ks, [obj(i) for i in range(20)]) == [True] * 20
        b2 = make(("file", {"path": str(root), **options}))  # reuses what exists
        assert b2.put(keys(3), [obj(i) for i in range(3)]) == [True] * 3
        b2.close()
    finally:
        b.close()
    dirs, files = created_paths(root)
    assert len(dirs) > 20 and len(files) > 20  # fan-out dirs, objects, .hicache-usage
    assert any(f.name == ".hicache-usage" for f in files)
    assert {p: mode(p) for p in dirs} == {p: dir_mode for p in dirs}
    assert {p: mode(p) for p in files} == {p: file_mode for p in files}


def test_temp_files_get_the_mode_too(tmp_path):
    final = file_io.object_path(str(tmp_path), "k")
    file_io.make_fanout_dirs(final, 0o700, 0o022)
    tmp = file_io.write_temp(final, [obj(0)[0]], fsync=False, mode=0o640, umask=0o077)
    assert mode(Path(tmp)) == 0o640


def test_world_writable_directory_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ValueError, match="writable by every user.*allow_shared_dir") as err:
        make(("file", {"path": str(root)}))
    assert str(root) in str(err.value)
    os.chmod(root, 0o1777)  # sticky does not help: others can still add objects
    with pytest.raises(ValueError, match="allow_shared_dir"):
        make(("file", {"path": str(root)}))
    b = make(("file", {"path": str(root), "allow_shared_dir": True}))
    ks = keys(1)
    assert b.put(ks, [obj(0)]) == [True]
    b.close()


def test_group_writable_directory_of_our_own_is_fine(tmp_path):
    root = tmp_path / "group"
    root.mkdir()
    os.chmod(root, 0o770)
    make(("file", {"path": str(root)})).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_directory_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    os.chown(root, 4242, 4242)
    with pytest.raises(ValueError, match="owned by uid 4242.*allow_shared_dir"):
        make(("file", {"path": str(root)}))
    make(("file", {"path": str(root), "allow_shared_dir": True})).close()


@pytest.mark.parametrize("options, name", [
    ({"file_mode": 660}, "file_mode"),  # JSON has no octal: 660 decimal is not 0o660
    ({"file_mode": "0400"}, "file_mode"),  # the owner could not write
    ({"file_mode": "rw-rw----"}, "file_mode"),
    ({"dir_mode": "0600"}, "dir_mode"),  # the owner could not enter it
    ({"dir_mode": True}, "dir_mode"),
    ({"allow_shared_dir": "yes"}, "allow_shared_dir"),
    ({"fsync": 1}, "fsync"),
    ({"file_mods": "0600"}, "file_mods"),
])
def test_bad_options_name_the_option(tmp_path, options, name):
    with pytest.raises(ValueError, match=f"file backend option.*{name}"):
        make(("file", {"path": str(tmp_path / "l3"), **options}))
