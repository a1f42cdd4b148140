"""Options of the ``file`` L3 backend, parsed once into a frozen dataclass."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def default_path() -> str:
    """``$XDG_CACHE_HOME/vllm_hicache/l3``, else ``~/.cache/vllm_hicache/l3``:
    a disk-backed per-user location (``/tmp`` is often RAM-backed tmpfs)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vllm_hicache", "l3")


@dataclass(frozen=True)
class FileBackendConfig:
    # Directory of the objects (created if missing; "~" expanded).
    path: str
    # Capacity of stored objects in bytes, LRU-evicted beyond it; 0 = unlimited.
    max_bytes: int = 0
    # Threads one batch's reads/writes are spread over (1 = the calling thread).
    num_io_threads: int = 4
    # fsync each object and its directory before a put reports success.
    fsync: bool = False

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> FileBackendConfig:
        accepted = ("path", "max_bytes", "num_io_threads", "fsync")
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(
                f"unknown file backend option(s) {unknown}; accepted: {list(accepted)}"
            )
        path = options.get("path", default_path())
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"invalid file backend option path={path!r}; expected a directory")
        fsync = options.get("fsync", False)
        if not isinstance(fsync, bool):
            raise ValueError(f"invalid file backend option fsync={fsync!r}; expected true/false")
        return cls(
            path=os.path.abspath(os.path.expanduser(str(path))),
            max_bytes=_int_option(options, "max_bytes", 0, 0, 1 << 62),
            num_io_threads=_int_option(options, "num_io_threads", 4, 1, 256),
            fsync=fsync,
        )


def _int_option(options: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = options.get(name, default)
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or not low <= value <= high:
        raise ValueError(
            f"invalid file backend option {name}={value!r}; expected an integer in [{low}, {high}]"
        )
    return int(value)
