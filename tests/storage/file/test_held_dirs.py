"""The first-level fan-out directories a store holds open (store_dir.py): a
write walks only its leaf, yet a held directory removed behind the store's
back is made again (never followed if a symlink replaced it), and close
releases every descriptor."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from tests.storage.conformance import empty, obj
from tests.storage.file.fixtures import backend, build, root, spec  # noqa: F401
from vllm_hicache.storage.file import io as file_io
from vllm_hicache.storage.file import store_dir
from vllm_hicache.storage.file.store_dir import StoreDir


def keys_under_one_top(n: int) -> list[str]:
    """``n`` valid keys whose objects share their first-level directory."""
    by_top: dict[str, list[str]] = {}
    for i in range(100_000):
        key = f"held-{i}"
        group = by_top.setdefault(file_io.object_location(key)[0][0], [])
        group.append(key)
        if len(group) == n:
            return group
    raise AssertionError("no such keys")


def open_fds_under(directory: Path) -> int:
    """This process's descriptors open on ``directory`` or below it (other
    threads of the suite may open and close descriptors of their own meanwhile)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if target == str(directory) or target.startswith(f"{directory}/"):
            count += 1
    return count


def test_a_second_write_below_the_same_top_opens_only_its_leaf(tmp_path, monkeypatch):
    store = StoreDir.open(str(tmp_path / "s"), dir_mode=0o700, umask=0o022,
                          allow_shared_dir=False, owner="test")
    opened: list[str] = []
    real = store_dir._open_subdir

    def counting(dir_fd, name, mode, umask):
        opened.append(name)
        return real(dir_fd, name, mode, umask)

    monkeypatch.setattr(store_dir, "_open_subdir", counting)
    try:
        for leaf in ("01", "02", "01"):
            os.close(store.open_dir(("aa", leaf), 0o700, 0o022))
        assert opened == ["aa", "01", "02", "01"]
    finally:
        store.close()


def test_a_removed_held_directory_is_made_again(backend, root):  # noqa: F811
    first, second, third = keys_under_one_top(3)
    assert backend.put([first], [obj(1)]) == [True]
    top = Path(file_io.object_path(str(root), first)).parent.parent
    shutil.rmtree(top)
    assert backend.exists_prefix([second]) == 0  # a miss, not an error
    assert backend.put([second], [obj(2)]) == [True]
    assert Path(file_io.object_path(str(root), second)).is_file()
    target = empty()
    assert backend.get([second], [target]) == [True]
    assert all((t == s).all() for t, s in zip(target, obj(2)))
    assert backend.put([third], [obj(3)]) == [True]
    assert backend.exists_prefix([second, third]) == 2


def test_a_symlink_replacing_a_held_directory_is_not_followed(tmp_path, backend, root):  # noqa: F811
    first, second = keys_under_one_top(2)
    assert backend.put([first], [obj(1)]) == [True]
    top = Path(file_io.object_path(str(root), first)).parent.parent
    shutil.rmtree(top)
    outside = tmp_path / "outside"
    outside.mkdir()
    top.symlink_to(outside)
    assert backend.put([second], [obj(2)]) == [False]
    assert backend.exists_prefix([second]) == 0
    assert list(outside.iterdir()) == []


def test_close_releases_the_held_descriptors(build, root):  # noqa: F811
    b = build()
    stored = b.put([f"k{i}" for i in range(64)], [obj(i) for i in range(64)])
    assert all(stored)
    assert open_fds_under(root.resolve()) > 1  # the root and some first-level directories
    b.close()
    assert open_fds_under(root.resolve()) == 0


def test_a_held_directory_gone_stale_on_nfs_is_opened_again(tmp_path, monkeypatch):
    """NFS answers ESTALE, not ENOENT, below a directory another machine removed."""
    store = StoreDir.open(str(tmp_path / "s"), dir_mode=0o700, umask=0o022,
                          allow_shared_dir=False, owner="test")
    os.close(store.open_dir(("aa", "01"), 0o700, 0o022))
    real = store_dir._open_subdir
    stale = [True]
    opened: list[str] = []

    def once_stale(dir_fd, name, mode, umask):
        opened.append(name)
        if name == "02" and stale:
            stale.clear()
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(dir_fd, name, mode, umask)

    monkeypatch.setattr(store_dir, "_open_subdir", once_stale)
    try:
        os.close(store.open_dir(("aa", "02"), 0o700, 0o022))
        assert opened == ["02", "aa", "02"]  # the held "aa" replaced, then the leaf
    finally:
        store.close()


def test_descriptors_of_removed_directories_do_not_pile_up(backend, root):  # noqa: F811
    """A store emptied by hand again and again while in use costs no descriptors."""
    first, second = keys_under_one_top(2)
    assert backend.put([first], [obj(1)]) == [True]
    top = Path(file_io.object_path(str(root), first)).parent.parent
    before = open_fds_under(root.resolve())  # removed ones too: "... (deleted)"
    for i in range(20):
        shutil.rmtree(top)
        assert backend.put([second if i % 2 else first], [obj(i)]) == [True]
    assert open_fds_under(root.resolve()) == before
