"""Options of the ``file`` L3 backend, parsed once into a frozen dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hicache.storage.options import Options, directory, flag, integer, option, permissions


def default_path() -> str:
    """``$XDG_CACHE_HOME/vllm_hicache/l3``, else ``~/.cache/vllm_hicache/l3``:
    a disk-backed per-user location (``/tmp`` is often RAM-backed tmpfs)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return directory(os.path.join(cache, "vllm_hicache", "l3"))


@dataclass(frozen=True)
class FileBackendConfig(Options):
    owner = "file backend"

    # Directory of the objects ("~" expanded); created if missing, and it must
    # be writable at start.
    path: str = option(default_factory=default_path, parse=directory)
    # Capacity of stored objects in bytes; beyond it the least recently used
    # objects are deleted, and a put of an object that cannot fit at all is
    # refused. 0 = unlimited.
    max_bytes: int = option(0, parse=integer(0, 1 << 62))
    # Threads one batch's reads/writes are spread over, in contiguous slices
    # (the calling thread runs one; 1 = the calling thread only). Cold reads
    # gain most (1.8-1.9x one thread on a 2-vCPU VM's disk); on fewer cores
    # than threads, reads served by the page cache lose a little. Backups run
    # in the background and write their batches on their own thread
    # (io_threads.py).
    num_io_threads: int = option(4, parse=integer(1, 256))
    # fsync each object and its directory before a put reports success
    # (durable across power loss; slower).
    fsync: bool = option(False, parse=flag)
    # Permissions of the files and directories the backend creates, exactly
    # (the umask does not apply), as octal strings. Owner-only by default;
    # e.g. "0660"/"0770" for a store shared by a group, which also needs
    # allow_shared_dir (modes letting others write are refused without it).
    file_mode: int = option(0o600, parse=permissions(0o600))
    dir_mode: int = option(0o700, parse=permissions(0o700))
    # Accept a store directory that others can write to (owned by another
    # user, group- or world-writable, or an ACL granting write; a root symlink
    # owned by another user), and modes letting others write; refused
    # otherwise, as anyone who can write it can replace objects
    # (storage_secret makes such objects misses).
    allow_shared_dir: bool = option(False, parse=flag)
