"""DaemonPool: futures like an executor's, and a stuck call never keeps the
process from exiting (the reason it exists); background pools run below
the process's priority and still start every job within their patience."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_hicache import io_threads
from vllm_hicache.daemon_pool import DaemonPool
from vllm_hicache.io_threads import Background

REPO = Path(__file__).resolve().parents[2]


def test_results_errors_and_cancellation():
    pool = DaemonPool(1, "test")
    gate, started = threading.Event(), threading.Event()

    def block():
        started.set()
        return gate.wait(10)

    blocker = pool.submit(block)
    assert started.wait(10)
    queued = pool.submit(lambda: 1)
    failing = pool.submit(lambda: 1 / 0)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and failing.cancelled()
    gate.set()
    assert blocker.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 2)
    other = DaemonPool(2, "test")
    assert other.submit(lambda x: x * 2, 21).result(timeout=10) == 42
    with pytest.raises(ZeroDivisionError):
        other.submit(lambda: 1 / 0).result(timeout=10)
    other.shutdown(wait=True, timeout_s=10)


def test_a_stuck_call_does_not_hold_up_exit():
    script = (
        "import threading\n"
        "from vllm_hicache.daemon_pool import DaemonPool\n"
        "pool = DaemonPool(1, 'stuck')\n"
        "pool.submit(threading.Event().wait)\n"  # never returns
        "pool.shutdown(wait=True, timeout_s=0.2)\n"
        "print('exiting')\n"
    )
    start_s = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr
    # A ThreadPoolExecutor would block here until the test's 60 s timeout.
    assert time.monotonic() - start_s < 30


# --- background pools: below the process's priority, never starved ----------

BG = Background(nice=5, patience_s=0.3)


def thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def who() -> tuple[str, int, Background | None]:
    return threading.current_thread().name, thread_nice(), io_threads.current_background()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_background_threads_run_below_the_process_and_know_it():
    base = thread_nice()
    pool = DaemonPool(2, "test-bg", BG)
    try:
        name, nice, background = pool.submit(who).result(timeout=10)
    finally:
        pool.shutdown()
    assert name.startswith("test-bg-") and not name.endswith("rescue")
    assert nice == min(19, base + BG.nice) and background == BG
    assert thread_nice() == base and io_threads.current_background() is None  # caller untouched


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_a_pool_made_on_a_background_thread_is_lowered_once_not_twice():
    """A thread inherits its creator's nice value: a background pool made
    on a background thread still runs BG.nice below the process."""
    base = thread_nice()
    outer = DaemonPool(1, "test-bg", BG)

    def make_inner_and_ask() -> int:
        inner = DaemonPool(1, "test-in", BG)
        try:
            return inner.submit(thread_nice).result(timeout=10)
        finally:
            inner.shutdown()

    try:
        assert outer.submit(make_inner_and_ask).result(timeout=10) == min(19, base + BG.nice)
    finally:
        outer.shutdown()


def test_a_job_the_background_threads_do_not_take_is_rescued_after_its_patience():
    """Stand-in for a busy core: every background thread is held, so only
    the rescuer (at the process's priority) can start the next job, and it
    waits out the patience first."""
    base = thread_nice()
    pool = DaemonPool(1, "test-bg", BG)
    gate, held = threading.Event(), threading.Event()
    try:
        blocker = pool.submit(lambda: (held.set(), gate.wait(10)))
        assert held.wait(10)
        submitted = time.monotonic()
        name, nice, background = pool.submit(who).result(timeout=10)
        waited_s = time.monotonic() - submitted
    finally:
        gate.set()
        pool.shutdown()
    assert blocker.result(timeout=10)[1] is True
    assert name == "test-bg-rescue" and nice == base and background is None
    assert waited_s >= BG.patience_s - 0.01  # not before its patience


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_hurry_runs_every_queued_job_at_the_callers_priority_at_once():
    """A stop's flush: jobs the background threads would run niced, or the
    rescuer only after its (here endless) patience, run at once on new
    threads at the caller's priority; the background thread retires after
    its running job; a second hurry adds nothing."""
    base = thread_nice()
    pool = DaemonPool(2, "test-bg", Background(nice=5, patience_s=60.0))
    gates = [threading.Event() for _ in range(2)]
    held = [threading.Event() for _ in range(2)]
    try:
        running = [pool.submit(lambda i=i: (held[i].set(), gates[i].wait(10), who()))
                   for i in range(2)]
        assert all(h.wait(10) for h in held)
        futures = [pool.submit(who) for _ in range(4)]
        time.sleep(0.2)
        assert not any(f.done() for f in futures)  # patient: nobody took them
        pool.hurry()
        pool.hurry()
        ran = [f.result(timeout=10) for f in futures]
        gates[0].set()
        name, nice, _ = running[0].result(timeout=10)[2]
        assert nice == min(19, base + 5)  # a running job finishes where it is
        # ... and its thread retires instead of taking another job.
        for freed in [t for t in threading.enumerate() if t.name == name]:  # if not gone yet
            freed.join(timeout=10)
            assert not freed.is_alive()
        assert all(pool.submit(who).result(timeout=10)[2] is None for _ in range(3))
        foreground = [t for t in threading.enumerate() if t.name.startswith("test-bg-h")]
    finally:
        for gate in gates:
            gate.set()
        pool.shutdown()
    assert all(nice == base and background is None for _, nice, background in ran)
    assert {name for name, _, _ in ran} <= {"test-bg-h0", "test-bg-h1", "test-bg-rescue"}
    assert sorted(t.name for t in foreground) == ["test-bg-h0", "test-bg-h1"]
    assert pool.hurried


def test_hurry_is_refused_on_a_background_thread_and_a_no_op_elsewhere():
    pool = DaemonPool(1, "test-bg", BG)
    try:
        with pytest.raises(RuntimeError, match="background thread"):
            pool.submit(pool.hurry).result(timeout=10)
        assert not pool.hurried
    finally:
        pool.shutdown()
    plain = DaemonPool(1, "test-plain")
    plain.hurry()  # no background: nothing to hurry
    assert not plain.hurried and plain.submit(lambda: 3).result(timeout=10) == 3
    plain.shutdown()
    pool.hurry()  # shut down: nothing
    assert not pool.hurried


def test_a_background_pool_drains_what_is_queued_at_shutdown_unless_cancelled():
    pool = DaemonPool(1, "test-bg", Background(nice=5, patience_s=60.0))
    gate, held = threading.Event(), threading.Event()
    pool.submit(lambda: (held.set(), gate.wait(10)))
    assert held.wait(10)
    queued = pool.submit(lambda: 7)
    pool.shutdown(wait=False)  # no patience once shut down: the rescuer runs it
    assert queued.result(timeout=10) == 7
    gate.set()
    other = DaemonPool(1, "test-bg", BG)
    held.clear()
    other.submit(lambda: (held.set(), gate.wait(10)))
    assert held.wait(10)
    dropped = other.submit(lambda: 8)
    other.shutdown(wait=True, cancel_futures=True, timeout_s=10)
    assert dropped.cancelled()


def test_background_settings_are_checked():
    with pytest.raises(ValueError, match="nice >= 1"):
        Background(nice=0, patience_s=1.0)
