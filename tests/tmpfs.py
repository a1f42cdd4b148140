"""A scratch directory in memory (/dev/shm) where the machine has one.

For what a test means to run at memory speed (a node tier; a store whose
slowness the test sets itself): on the test's disk a busy CI machine's
writeback can add seconds per write, and the test would time the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def tmpfs_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory, removed on exit; on /dev/shm if it exists."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield Path(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
