"""The ``file`` backend's permissions: what it creates is owner-only unless
``file_mode``/``dir_mode`` say otherwise, whatever the umask, and a store
directory that others can write to (world, group, ACL, another owner), or
modes letting others write, are refused unless ``allow_shared_dir``.
Attacks through the directory (symlinks, FIFOs): test_hostile.py."""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import pytest

from tests.storage.conformance import keys, make, obj
from vllm_hicache.storage.file import access
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
    ({"file_mode": "0660", "dir_mode": "0770", "allow_shared_dir": True},  # a group-shared store
     0o660, 0o770),
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
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tmp = file_io.write_temp(fd, "k.hckv", [obj(0)[0]], fsync=False, mode=0o640,
                                 umask=0o077)
    finally:
        os.close(fd)
    assert mode(tmp_path / tmp) == 0o640


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


def test_group_writable_directory_is_refused_unless_shared(tmp_path):
    root = tmp_path / "group"
    root.mkdir()
    os.chmod(root, 0o770)
    gid = root.stat().st_gid
    with pytest.raises(ValueError, match=f"writable by its group \\(gid {gid}, mode 0770\\)"
                                         ".*allow_shared_dir") as err:
        make(("file", {"path": str(root)}))
    assert str(root) in str(err.value)
    b = make(("file", {"path": str(root), "allow_shared_dir": True}))
    assert b.put(keys(1), [obj(0)]) == [True]
    b.close()


@pytest.mark.parametrize("options", [{"dir_mode": "0770"}, {"file_mode": "0662"},
                                     {"dir_mode": "0777", "file_mode": "0666"}])
def test_modes_letting_others_write_need_allow_shared_dir(tmp_path, options):
    root = tmp_path / "l3"
    with pytest.raises(ValueError, match=r"file backend: (file|dir)_mode \d{4}.*"
                                         "let users other than the owner write.*allow_shared"):
        make(("file", {"path": str(root), **options}))
    assert not root.exists()  # refused before anything was created
    make(("file", {"path": str(root), "allow_shared_dir": True, **options})).close()


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


# --- POSIX ACLs ---

def acl(*entries: tuple[int, int, int]) -> bytes:
    """``system.posix_acl_access`` bytes: version 2, then (tag, perm, id) in
    the kernel's order (user obj, users, group obj, groups, mask, other)."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
RWX, RX, NONE = 7, 5, 0
UNDEFINED = 0xFFFFFFFF  # the id of entries that have none


def entries(*named, group=RX, mask=None, other=RX):
    out = [(USER_OBJ, RWX, UNDEFINED), *named, (GROUP_OBJ, group, UNDEFINED)]
    out.sort(key=lambda e: (e[0], e[2]))
    if mask is not None:
        out.append((MASK, mask, UNDEFINED))
    return [*out, (OTHER, other, UNDEFINED)]


@pytest.mark.parametrize("raw_entries, writers", [
    (entries(), []),  # a minimal ACL: mode 0755
    (entries(group=RWX), ["the owning group"]),
    (entries(other=RWX), ["every user"]),
    (entries((USER, RWX, 4242), mask=RWX), ["user 4242"]),
    (entries((USER, RWX, 4242), mask=RX), []),  # the mask takes the write away
    (entries((GROUP, RWX, 77), mask=RWX), ["group 77"]),
    (entries((USER, RWX, 1000), mask=RWX), []),  # a named entry for ourselves
    (entries((USER, RX, 4242), (GROUP, RX, 77), mask=RWX), []),
])
def test_acl_writers(raw_entries, writers):
    assert access.acl_writers(acl(*raw_entries), our_uid=1000) == writers


@pytest.mark.parametrize("raw", [b"", b"\x02\x00\x00", acl()[:4] + b"\x01\x00",
                                 struct.pack("<I", 1) + acl(*entries())[4:]])
def test_malformed_acl_is_an_error(raw):
    with pytest.raises(ValueError, match="ACL"):
        access.acl_writers(raw, our_uid=0)


def set_acl(path: Path, raw: bytes) -> None:
    try:
        os.setxattr(path, "system.posix_acl_access", raw)
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip(f"no POSIX ACLs on {path}'s file system")
        raise


def test_acl_granting_another_user_write_is_refused(tmp_path):
    """The owning group and others cannot write; the ACL lets user 4242."""
    root = tmp_path / "acl"
    root.mkdir(mode=0o700)
    set_acl(root, acl(*entries((USER, RWX, 4242), group=RX, mask=RWX, other=NONE)))
    with pytest.raises(ValueError, match="its ACL lets user 4242 write it.*allow_shared_dir"):
        make(("file", {"path": str(root)}))
    make(("file", {"path": str(root), "allow_shared_dir": True})).close()


def test_acl_whose_mask_denies_write_is_accepted(tmp_path):
    root = tmp_path / "acl"
    root.mkdir(mode=0o700)
    set_acl(root, acl(*entries((USER, RWX, 4242), group=RX, mask=RX, other=NONE)))
    assert mode(root) == 0o750  # the group bits show the mask
    b = make(("file", {"path": str(root)}))
    assert b.put(keys(1), [obj(0)]) == [True]
    b.close()
