"""The ``nixl`` backend's POSIX store: owner-only files and directories unless
``file_mode``/``dir_mode`` say otherwise, whatever the umask; a directory
others can write to is refused unless ``allow_shared_dir``."""

from __future__ import annotations

import os

import pytest

from tests.storage.conformance import keys, make, obj
from tests.storage.file.test_permissions import created_paths, mode, umask  # noqa: F401

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("mask", [0o022, 0o077])
@pytest.mark.parametrize("options, file_mode, dir_mode", [
    ({}, 0o600, 0o700),
    ({"file_mode": "0660", "dir_mode": "0770", "allow_shared_dir": True},  # a group-shared store
     0o660, 0o770),
])
def test_created_paths_have_exactly_the_modes(tmp_path, umask, mask, options,  # noqa: F811
                                              file_mode, dir_mode):
    umask(mask)
    root = tmp_path / "store" / "l3"
    b = make(("nixl", {"path": str(root), **options}))
    try:
        assert b.put(keys(20), [obj(i) for i in range(20)]) == [True] * 20
    finally:
        b.close()
    dirs, files = created_paths(root)
    assert len(dirs) == 257 and len(files) == 20  # root + fan-out, one file per object
    assert {p: mode(p) for p in dirs} == {p: dir_mode for p in dirs}
    assert {p: mode(p) for p in files} == {p: file_mode for p in files}


def test_world_writable_directory_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ValueError, match="nixl backend.*writable by every user.*allow_shared"):
        make(("nixl", {"path": str(root)}))
    b = make(("nixl", {"path": str(root), "allow_shared_dir": True}))
    try:
        assert b.put(keys(1), [obj(0)]) == [True]
    finally:
        b.close()


def test_group_writable_directory_or_modes_are_refused_unless_shared(tmp_path):
    root = tmp_path / "group"
    root.mkdir()
    os.chmod(root, 0o770)
    with pytest.raises(ValueError, match="nixl backend.*writable by its group.*allow_shared"):
        make(("nixl", {"path": str(root)}))
    with pytest.raises(ValueError, match="nixl backend.*dir_mode 0770 let users other"):
        make(("nixl", {"path": str(tmp_path / "l3"), "dir_mode": "0770"}))
    b = make(("nixl", {"path": str(root), "allow_shared_dir": True}))
    try:
        assert b.put(keys(1), [obj(0)]) == [True]
    finally:
        b.close()


@pytest.mark.parametrize("options, name", [
    ({"file_mode": "0400"}, "file_mode"),
    ({"dir_mode": "0600"}, "dir_mode"),
    ({"allow_shared_dir": "yes"}, "allow_shared_dir"),
])
def test_bad_options_name_the_option(tmp_path, options, name):
    with pytest.raises(ValueError, match=f"nixl backend option.*{name}"):
        make(("nixl", {"path": str(tmp_path / "l3"), **options}))


def test_posix_options_are_refused_for_the_obj_plugin():
    with pytest.raises(ValueError, match=r"\['file_mode'\] do not apply to plugin='OBJ'"):
        make(("nixl", {"plugin": "OBJ", "bucket": "b", "file_mode": "0600"}))
