"""openat2 beneath a held directory (storage/file/beneath.py) with real
symlinks: one call that refuses every symlink and every escape."""

from __future__ import annotations

import errno
import os

import pytest

from vllm_hicache.storage.file import beneath

READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@pytest.fixture
def root(tmp_path):
    (tmp_path / "store" / "aa").mkdir(parents=True)
    (tmp_path / "store" / "aa" / "obj").write_bytes(b"ours")
    (tmp_path / "outside").write_bytes(b"theirs")
    fd = os.open(tmp_path / "store", os.O_RDONLY | os.O_DIRECTORY)
    if not beneath.available(fd):
        os.close(fd)
        pytest.skip("this kernel or sandbox has no openat2")
    yield tmp_path, fd
    os.close(fd)


def test_opens_a_path_below_the_directory(root):
    _, fd = root
    f = beneath.open_beneath(fd, "aa/obj", READ)
    try:
        assert os.read(f, 10) == b"ours"
    finally:
        os.close(f)


@pytest.mark.parametrize("plant", ["final", "middle"])
def test_a_symlink_anywhere_on_the_path_is_refused(root, plant):
    tmp, fd = root
    store = tmp / "store"
    if plant == "final":
        (store / "aa" / "link").symlink_to(tmp / "outside")
        path = "aa/link"
    else:
        (tmp / "elsewhere").mkdir()
        (tmp / "elsewhere" / "obj").write_bytes(b"theirs")
        (store / "bb").symlink_to(tmp / "elsewhere")
        path = "bb/obj"
    with pytest.raises(OSError) as err:
        beneath.open_beneath(fd, path, READ)
    assert err.value.errno == errno.ELOOP


def test_an_escape_from_the_directory_is_refused(root):
    _, fd = root
    with pytest.raises(OSError) as err:
        beneath.open_beneath(fd, "../outside", READ)
    assert err.value.errno == errno.EXDEV


def test_a_missing_object_is_file_not_found(root):
    _, fd = root
    with pytest.raises(FileNotFoundError):
        beneath.open_beneath(fd, "aa/missing", READ)
