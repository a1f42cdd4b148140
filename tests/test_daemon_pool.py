"""DaemonPool: futures like an executor's, and a stuck call never keeps the
process from exiting (the reason it exists)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_hicache.daemon_pool import DaemonPool

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
