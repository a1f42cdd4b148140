"""MappingWarmer: a shared tmpfs mapping is mapped into the process (its
resident set grows to the whole range) without the caller touching a page;
a range the kernel refuses ends the thread quietly; stop is prompt."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from vllm_hicache.l3.map_warmer import CHUNK_BYTES, MappingWarmer

SIZE = 3 * CHUNK_BYTES + 12345


def resident_kib(address: int) -> int:
    """Rss of the mapping that starts at ``address`` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{address:x}-"))
    for line in lines[start + 1:]:
        if line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no Rss line")


@pytest.fixture
def tmpfs_mapping():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    fd = os.open("/dev/shm", os.O_RDWR | os.O_TMPFILE, 0o600)
    os.posix_fallocate(fd, 0, SIZE)
    mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    # Unmapped by the collector once the view is gone (pytest holds it
    # until after teardown, so close() would find it still exported).
    yield np.frombuffer(mapping, np.uint8)


def test_the_whole_range_is_mapped_without_touching_it(tmpfs_mapping):
    address = tmpfs_mapping.ctypes.data
    assert resident_kib(address) == 0
    warmer = MappingWarmer(address, tmpfs_mapping.nbytes)
    assert warmer.wait(30)
    if warmer.warmed_bytes == 0:
        pytest.skip("this kernel has no MADV_POPULATE_READ")
    assert warmer.warmed_bytes == SIZE
    assert resident_kib(address) * 1024 >= SIZE - 4096
    warmer.stop()


def test_a_refused_range_ends_the_thread_quietly():
    warmer = MappingWarmer(4096, CHUNK_BYTES)  # nothing is mapped at page 1
    assert warmer.wait(10)
    assert warmer.warmed_bytes == 0
    warmer.stop()


def test_stop_ends_the_thread(tmpfs_mapping):
    warmer = MappingWarmer(tmpfs_mapping.ctypes.data, tmpfs_mapping.nbytes)
    warmer.stop()
    assert warmer.wait(0)
    assert warmer.warmed_bytes in (0, CHUNK_BYTES, 2 * CHUNK_BYTES, 3 * CHUNK_BYTES, SIZE)
