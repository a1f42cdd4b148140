"""The tests' port picker and start-up wait (tests/ports.py, tests/e2e/test_serve.py)."""

import subprocess
import sys
import time

import pytest

from tests.e2e.test_serve import THREAD_DIED, wait_healthy
from tests.ports import ephemeral_range, free_ports


def test_ports_are_outside_the_ephemeral_range_and_distinct():
    low, high = ephemeral_range()
    ports = free_ports(20) + free_ports(20)
    assert len(set(ports)) == 40  # never handed out twice by one process
    assert all(not low <= p <= high for p in ports)
    assert all(1024 < p < 65536 for p in ports)


def test_start_up_wait_fails_at_once_when_a_server_thread_died(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(f"{THREAD_DIED}nixl_handshake_listener:\nzmq.error.ZMQError: "
                   "Address already in use\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match="a thread died"):
            wait_healthy(f"http://127.0.0.1:{free_ports(1)[0]}", proc, "decode", 60.0,
                         log.read_text, interval_s=0.1, log_text=log.read_text)
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.wait()
