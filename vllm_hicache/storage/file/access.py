"""Who besides us can write a store directory, judged on the descriptor we hold.

A store directory is ours alone when this process's user owns it and neither
its mode bits nor its POSIX ACL let anyone else write it. Whoever can write
it can rename their own files over our objects, plant symlinks, FIFOs or a
usage file; the backends refuse to follow or read those, but a planted
object of the right size still loads unless ``storage_secret`` is set. So a
directory others can write is refused unless the operator declares the store
shared (``allow_shared_dir``).

The check reads the open directory (``fstat``, ``fgetxattr``), never its
path again, so what was checked is what later operations use (store_dir.py).

POSIX ACLs: Linux stores the access ACL in the ``system.posix_acl_access``
extended attribute: a little-endian u32 version (2), then 8-byte entries
(u16 tag, u16 permission bits, u32 uid/gid). When an ACL is present, the
group mode bits show the ACL's mask, not the owning group's rights, so the
entries decide: the owning group, a named group, or a named user other than
us holding write counts when the mask grants write too. NFSv4 ACLs
(``system.nfs4_acl``) are not inspected.
"""

from __future__ import annotations

import errno
import os
import stat
import struct

_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")
# Tags of acl_ea_entry (linux/posix_acl_xattr.h).
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ACL_WRITE = 0x02
# The attribute is absent, or the file system keeps no POSIX ACLs.
_NO_ACL = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP}


def acl_writers(raw: bytes, our_uid: int) -> list[str]:
    """Who other than ``our_uid`` may write, by the access ACL ``raw`` (the
    xattr's bytes): e.g. ``["group 100 (owning group)", "user 1001"]``.
    ValueError if ``raw`` is not a version 2 ACL."""
    if len(raw) < _ACL_HEADER.size or (len(raw) - _ACL_HEADER.size) % _ACL_ENTRY.size:
        raise ValueError(f"malformed POSIX ACL ({len(raw)} bytes)")
    (version,) = _ACL_HEADER.unpack_from(raw)
    if version != _ACL_VERSION:
        raise ValueError(f"POSIX ACL of unknown version {version}")
    entries = [_ACL_ENTRY.unpack_from(raw, offset)
               for offset in range(_ACL_HEADER.size, len(raw), _ACL_ENTRY.size)]
    # Without a mask entry (a minimal ACL) there are no named entries, and the
    # owning group's entry is the group mode bits.
    mask_writes = all(perm & _ACL_WRITE for tag, perm, _ in entries if tag == _MASK)
    writers = []
    for tag, perm, ident in entries:
        if not perm & _ACL_WRITE:
            continue
        if tag == _USER and ident != our_uid and mask_writes:
            writers.append(f"user {ident}")
        elif tag == _GROUP and mask_writes:
            writers.append(f"group {ident}")
        elif tag == _GROUP_OBJ and mask_writes:
            writers.append("the owning group")
        elif tag == _OTHER:
            writers.append("every user")
    return writers


def _read_acl(fd: int) -> bytes | None:
    getxattr = getattr(os, "getxattr", None)
    if getxattr is None:  # not Linux: no POSIX ACL attribute to read
        return None
    try:
        return getxattr(fd, _ACL_XATTR)
    except OSError as err:
        if err.errno in _NO_ACL:
            return None
        raise


def others_who_can_write(fd: int) -> list[str]:
    """Why someone other than this process's user can write the directory
    open as ``fd`` (empty: nobody can); ValueError if it is no directory."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError("it is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if st.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by this process (uid "
                        f"{os.geteuid()})")
    acl = _read_acl(fd)
    if acl is None:
        if mode & stat.S_IWOTH:
            problems.append(f"it is writable by every user (mode {mode:04o})")
        if mode & stat.S_IWGRP:
            problems.append(f"it is writable by its group (gid {st.st_gid}, mode {mode:04o})")
        return problems
    writers = acl_writers(acl, os.geteuid())
    if "every user" in writers:
        problems.append(f"it is writable by every user (mode {mode:04o})")
    named = [w for w in writers if w != "every user"]
    if named:
        problems.append(f"its ACL lets {', '.join(named)} write it (gid {st.st_gid})")
    return problems


def check_store_dir(fd: int, path: str, allow_shared_dir: bool, owner: str) -> None:
    """ValueError naming ``path`` and the reason if others can write the
    directory open as ``fd`` and ``allow_shared_dir`` is not set."""
    try:
        problems = others_who_can_write(fd)
    except ValueError as err:
        raise ValueError(f"{owner}: refusing directory {path!r}: {err}") from None
    if problems and not allow_shared_dir:
        raise ValueError(
            f"{owner}: refusing directory {path!r}: {' and '.join(problems)}, so others "
            "can replace its objects. Use a directory of your own (chmod go-w, no ACL "
            "granting write), or set allow_shared_dir: true (then set storage_secret, so "
            "objects others plant are misses)")


def check_modes(file_mode: int, dir_mode: int, allow_shared_dir: bool, owner: str) -> None:
    """ValueError if ``file_mode``/``dir_mode`` let others write what the
    backend creates while the store is not declared shared: asking for a
    group-writable store is asking for a shared one."""
    loose = [f"{name} {mode:04o}" for name, mode in (("file_mode", file_mode),
                                                      ("dir_mode", dir_mode))
             if mode & (stat.S_IWGRP | stat.S_IWOTH)]
    if loose and not allow_shared_dir:
        raise ValueError(
            f"{owner}: {' and '.join(loose)} let users other than the owner write the "
            "store; set allow_shared_dir: true for a store shared that way (and "
            "storage_secret, so objects others plant are misses)")
