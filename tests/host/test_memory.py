"""Sizing the pool against host memory, before allocating it."""

from __future__ import annotations

import pytest

from vllm_hicache.host import MemInfo, check_fits, read_meminfo, reserve_bytes
from vllm_hicache.host.memory import GiB


def test_read_meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       16384 kB\nMemFree:  100 kB\nMemAvailable:    8192 kB\n")
    assert read_meminfo(path) == MemInfo(16384 * 1024, 8192 * 1024)


def test_read_meminfo_of_this_machine():
    info = read_meminfo()
    assert 0 < info.available_bytes <= info.total_bytes


def test_reserve_is_at_least_two_gib_or_five_percent():
    assert reserve_bytes(8 * GiB) == 2 * GiB
    assert reserve_bytes(1000 * GiB) == 50 * GiB


def test_fits():
    check_fits(5 * GiB, MemInfo(64 * GiB, 10 * GiB))


def test_too_big_names_the_numbers():
    info = MemInfo(total_bytes=16 * GiB, available_bytes=10 * GiB)
    with pytest.raises(ValueError) as err:
        check_fits(9 * GiB, info)
    message = str(err.value)
    for number in (9 * GiB, 10 * GiB, 2 * GiB):
        assert str(number) in message
    assert "hicache_size" in message


def test_explicit_reserve():
    check_fits(9 * GiB, MemInfo(64 * GiB, 10 * GiB), reserve=0)
    with pytest.raises(ValueError):
        check_fits(9 * GiB, MemInfo(64 * GiB, 10 * GiB), reserve=GiB + 1)
