"""The breaker's driver (l3/health_check.py): its round-trip check against
real and failing stores, and the monitor feeding the breaker (fake clock,
then its own thread), logging each trip and resume once."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from tests.connector.mem_backend import MemBackend
from tests.fake_clock import FakeClock
from vllm_hicache.keys import KeyNamespace
from vllm_hicache.l3.breaker import BreakerConfig, BreakerState
from vllm_hicache.l3.canary import canary_hash, is_canary_key
from vllm_hicache.l3.health_check import L3Health, probe_key, round_trip_check
from vllm_hicache.storage import StorageContext

NS = KeyNamespace("test/model", "bfloat16", "page_first_direct", 8, 1, 0, page_format="fmt")


def mem_backend() -> MemBackend:
    return MemBackend({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))


def test_the_probe_object_is_reserved_and_not_the_canary():
    key = probe_key(NS)
    assert is_canary_key(key)  # object counts and tools skip it like the canary
    assert key != NS.object_keys([canary_hash(NS)])[0]
    assert key.startswith(NS.tag)


def test_round_trip_check_passes_on_a_working_store_and_names_each_failure():
    backend = mem_backend()
    assert round_trip_check(backend, probe_key(NS), 100)() == ""
    assert len(backend.data[probe_key(NS)]) == 100

    class Refusing(MemBackend):
        def put(self, keys, sources):
            return [False] * len(keys)

    class Forgetful(MemBackend):
        def exists_prefix(self, keys):
            return 0

    class Garbling(MemBackend):
        def get(self, keys, targets):
            ok = super().get(keys, targets)
            targets[0][0][3] ^= 1
            return ok

    class Raising(MemBackend):
        def put(self, keys, sources):
            raise ConnectionError("refused")

    ctx = StorageContext("scheduler", 0, 1, 64)
    for cls, detail in ((Refusing, "write refused"), (Forgetful, "not found"),
                        (Garbling, "other bytes"), (Raising, "ConnectionError")):
        backend = cls({"store": uuid.uuid4().hex}, ctx)
        assert detail in round_trip_check(backend, probe_key(NS), 64)()


def test_a_check_writes_only_what_is_missing_or_changed():
    """Found and read back as it should be: no write (a rewrite every interval
    is a path no page takes, and a slow one on some filesystems); missing or
    holding other bytes: written again, then read back."""
    puts = []

    class Counting(MemBackend):
        def put(self, keys, sources):
            puts.append(list(keys))
            return super().put(keys, sources)

    backend = Counting({"store": uuid.uuid4().hex}, StorageContext("scheduler", 0, 1, 64))
    key = probe_key(NS)
    check = round_trip_check(backend, key, 64)
    assert check() == "" and puts == [[key]]
    for _ in range(3):
        assert check() == ""
    assert len(puts) == 1
    good = bytes(backend.data[key])
    backend.data[key] = bytes(64)  # another process's bytes, or a corruption
    assert check() == "" and len(puts) == 2 and bytes(backend.data[key]) == good
    del backend.data[key]  # a clear, or an eviction
    assert check() == "" and len(puts) == 3


def test_monitor_trips_on_failing_checks_and_resumes_with_one_log_line_each(caplog):
    clock = FakeClock(100.0)
    failing = threading.Event()
    failing.set()
    health = L3Health(BreakerConfig(2.0, 0.5, 1.0), lambda: "write refused" if failing.is_set()
                      else "", "mem", clock=clock, autostart=False)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_hicache.l3.health_check"):
            for _ in range(6):
                clock.now += 1.0
                health.step()  # collects the last check, starts the next one
                time.sleep(0.05)  # its thread runs it
                health.step()
            assert health.state != BreakerState.CLOSED and not health.usable
            assert health.trips == 1 and health.status()["last_failure"] == "write refused"
            assert health.state_gauge() in (1, 2)
            failing.clear()
            for _ in range(3):
                clock.now += 1.0
                health.step()
                time.sleep(0.05)
                health.step()
            assert health.usable and health.state_gauge() == 0
        lines = [r.getMessage() for r in caplog.records]
        assert sum("tripped" in m for m in lines) == 1, lines
        assert sum("healthy again" in m for m in lines) == 1, lines
        assert "write refused" in next(m for m in lines if "tripped" in m)
    finally:
        health.close()


def test_monitor_thread_trips_on_a_hung_store_and_close_does_not_wait_for_it():
    hang = threading.Event()
    health = L3Health(BreakerConfig(0.2, 0.05, 0.05), lambda: "" if hang.wait(10) else "x",
                      "mem")
    try:
        deadline = time.monotonic() + 5
        while health.usable and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not health.usable and "no answer" in str(health.status()["last_failure"])
        assert health.state == BreakerState.PROBING  # the hung check still decides
        start = time.monotonic()
    finally:
        health.close()
    assert time.monotonic() - start < 2.0
    hang.set()


def test_breaker_config_refuses_nonsense():
    with pytest.raises(ValueError, match="probe_interval_s"):
        BreakerConfig(1.0, 1.0, 0.0)


def test_a_check_that_raises_anything_is_a_failed_check():
    class Boom(BaseException):
        pass

    def check() -> str:
        raise Boom("out of the blue")

    clock = FakeClock(100.0)
    health = L3Health(BreakerConfig(0.0, 0.5, 1.0), check, "mem", clock=clock, autostart=False)
    try:
        clock.now += 1.0
        health.step()
        time.sleep(0.05)
        health.step()
        assert not health.usable and "Boom" in str(health.status()["last_failure"])
    finally:
        health.close()


def test_a_round_after_close_starts_no_check_and_logs_nothing(caplog):
    """The monitor may wake for one more round while the engine closes the
    breaker: that round must not submit to the closed pool (it used to log
    ``monitor step failed`` with a traceback at every shutdown)."""
    clock = FakeClock(100.0)
    checks: list[int] = []
    health = L3Health(BreakerConfig(2.0, 0.5, 1.0), lambda: checks.append(1) or "", "mem",
                      clock=clock, autostart=False)
    health.close()
    clock.now += 10.0  # a check is due
    with caplog.at_level(logging.WARNING, logger="vllm_hicache.l3.health_check"):
        health.step()
    time.sleep(0.05)
    assert checks == [] and not caplog.records
