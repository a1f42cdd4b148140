"""I/O threads leave the compute cores: every pool the worker half's I/O
runs on moves its threads to the configured cores, and nothing moves when
none are configured."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_hicache import io_threads
from vllm_hicache.daemon_pool import DaemonPool

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.fixture
def io_cores():
    """Configure the I/O cores for one test, then restore none."""
    def set_cores(cores):
        io_threads.configure(frozenset(cores))
    yield set_cores
    io_threads.configure(frozenset())


def thread_affinity() -> set[int]:
    return set(os.sched_getaffinity(0))


def test_cores_off_compute():
    assert io_threads.cores_off_compute({0, 1, 2, 3}, {1, 3}) == {0, 2}
    # Nothing bound (nobind, or a GPU platform): leave threads alone.
    assert io_threads.cores_off_compute({0, 1}, set()) == frozenset()
    # Every core computes: nothing left for I/O.
    assert io_threads.cores_off_compute({0, 1}, {0, 1}) == frozenset()


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed cores")
def test_daemon_pool_threads_run_on_the_io_cores(io_cores):
    io_cores({ALLOWED[0]})
    pool = DaemonPool(2, "test-io")
    try:
        seen = [pool.submit(thread_affinity).result(timeout=10) for _ in range(4)]
    finally:
        pool.shutdown()
    assert all(s == {ALLOWED[0]} for s in seen), seen
    assert thread_affinity() == set(ALLOWED)  # the caller stays where it was


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed cores")
def test_pool_initializer_pins_and_unconfigured_leaves_alone(io_cores):
    io_cores({ALLOWED[-1]})
    with ThreadPoolExecutor(1, initializer=io_threads.enter_io_thread) as pool:
        assert pool.submit(thread_affinity).result(timeout=10) == {ALLOWED[-1]}
    io_cores(set())
    with ThreadPoolExecutor(1, initializer=io_threads.enter_io_thread) as pool:
        assert pool.submit(thread_affinity).result(timeout=10) == set(ALLOWED)


def test_a_core_taken_away_leaves_the_thread_where_it_was(io_cores):
    io_cores({max(ALLOWED) + 4096})  # not a core of this machine
    pool = DaemonPool(1, "test-io")
    try:
        assert pool.submit(thread_affinity).result(timeout=10) == set(ALLOWED)
    finally:
        pool.shutdown()


def native_thread_name() -> str:
    return open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()


def test_pool_threads_carry_their_names_to_the_os():
    """``top -H`` and the benchmarks' CPU accounting tell our threads apart."""
    pool = DaemonPool(1, "hicache-l3")
    try:
        assert pool.submit(native_thread_name).result(timeout=10) == "hicache-l3-0"
    finally:
        pool.shutdown()
    with ThreadPoolExecutor(1, thread_name_prefix="hicache-a-long-pool-name",
                            initializer=io_threads.enter_io_thread) as executor:
        assert executor.submit(native_thread_name).result(timeout=10) == "hicache-a-long-"
    assert native_thread_name() != "hicache-l3-0"  # the caller keeps its own


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed cores")
def test_named_thread_is_named_and_stays_where_it_started(io_cores):
    """Our control threads (admin API, access log...): named, never moved."""
    io_cores({ALLOWED[0]})
    seen = []
    thread = io_threads.named_thread(lambda x: seen.append((x, native_thread_name(),
                                                            thread_affinity())),
                                     "hicache-test", args=(7,))
    assert thread.daemon
    thread.start()
    thread.join(10)
    assert seen == [(7, "hicache-test", set(ALLOWED))]
