"""The nixl L3 backend with NIXL's POSIX plugin on tmp_path (OBJ: test_obj.py).

Conformance, then what NIXL makes special: truncated or longer files,
concurrent overwrites, a failing request inside a batch, transfers that miss
their deadline (parked, reaped later, never touching the caller's buffers),
clear, and the start-up and option errors (staging: test_staging.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import threading
import time

import numpy as np
import pytest

from tests.storage.conformance import OBJECT_BYTES, BackendConformance, empty, keys, make, obj, same
from vllm_hicache.storage.nixl.config import NixlConfig
from vllm_hicache.storage.nixl.posix import PosixStore

pytestmark = pytest.mark.timeout(180)


def posix_spec(path, **extra) -> tuple[str, dict]:
    return ("nixl", {"path": str(path), **extra})


@pytest.fixture
def built():
    backends = []

    def build(spec, role="worker"):
        backends.append(make(spec, role))
        return backends[-1]

    yield build
    for b in backends:
        b.close()


class TestNixlPosixConformance(BackendConformance):
    @pytest.fixture
    def spec(self, tmp_path):
        return posix_spec(tmp_path / "l3")

    @pytest.fixture
    def backend(self, spec, built):
        return built(spec)


# --- objects of the wrong size -----------------------------------------------


def test_posix_truncated_or_longer_file_is_a_miss(tmp_path, built):
    b = built(posix_spec(tmp_path))
    ks = keys(3)
    assert b.put(ks, [obj(i) for i in range(3)]) == [True] * 3
    os.truncate(b._store.object_path(ks[0]), OBJECT_BYTES - 1)
    with open(b._store.object_path(ks[1]), "ab") as f:
        f.write(b"x")
    targets = [empty() for _ in ks]
    assert b.get(ks, targets) == [False, False, True]
    assert same(targets[2], obj(2))


def test_readers_never_see_a_partial_object_during_overwrites(tmp_path, built):
    b = built(posix_spec(tmp_path))
    key, versions = keys(1), [obj(0), obj(1)]
    b.put(key, versions[:1])
    stop, bad = time.monotonic() + 1.0, []

    def write():
        for i in itertools.count():
            if time.monotonic() > stop:
                return
            b.put(key, [versions[i % 2]])

    def read():
        while time.monotonic() < stop:
            target = empty()
            if b.get(key, [target]) != [True] or not any(same(target, v) for v in versions):
                bad.append(target)

    threads = [threading.Thread(target=f) for f in (write, write, read, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not bad


# --- failures inside NIXL ----------------------------------------------------


def test_failed_object_in_a_batch_costs_only_its_key(tmp_path, built, monkeypatch):
    """Scenario: 1. put 3 objects; 2. the middle file shrinks after get opened it
    (so NIXL's read comes up short and the batched request fails); 3. the batch is
    re-run per key: only the middle key misses; 4. the agent still works after."""
    b = built(posix_spec(tmp_path))
    ks = keys(3)
    assert b.put(ks, [obj(i) for i in range(3)]) == [True] * 3
    original = PosixStore._read_job

    def shrink_after_open(self, key, target):
        job = original(self, key, target)
        if key == ks[1]:
            os.truncate(self.object_path(key), 100)
        return job

    monkeypatch.setattr(PosixStore, "_read_job", shrink_after_open)
    targets = [empty() for _ in ks]
    assert b.get(ks, targets) == [True, False, True]
    assert same(targets[0], obj(0)) and same(targets[2], obj(2))
    monkeypatch.undo()
    again = [empty(), empty()]
    assert b.get([ks[0], ks[2]], again) == [True, True]


def run_past_deadline(b, timeout_s: float) -> list[str]:
    """Scenario: 1. NIXL reports every request as still running; 2. put and get
    return misses within timeout_s (+ slack), the requests are parked; 3. once
    NIXL reports again, the next call reaps them. Returns the keys put in 2."""
    stored, fresh = keys(2), keys(2)
    assert b.put(stored, [obj(0), obj(1)]) == [True, True]
    agent = b._engine.agent
    real_check = agent.check_xfer_state
    agent.check_xfer_state = lambda handle: "PROC"
    try:
        start = time.monotonic()
        assert b.put(fresh, [obj(2), obj(3)]) == [False, False]
        assert b.get(stored, [empty(), empty()]) == [False, False]
        assert time.monotonic() - start < 2 * timeout_s + 1.0
        assert b.stats()["parked_transfers"] >= 2
    finally:
        agent.check_xfer_state = real_check
    time.sleep(0.2)  # the parked requests really finish meanwhile
    targets = [empty(), empty()]
    assert b.get(stored, targets) == [True, True]
    assert same(targets[0], obj(0)) and same(targets[1], obj(1))
    assert b.stats()["parked_transfers"] == 0 and b.stats()["timeouts"] >= 2
    return fresh


def test_transfer_past_deadline_is_a_miss_within_the_bound(tmp_path, built):
    fresh = run_past_deadline(built(posix_spec(tmp_path, timeout_s=0.3)), 0.3)
    # The parked puts ended, but a put reported False is never published.
    leftovers = [n for d in os.scandir(tmp_path) for n in os.listdir(d.path)]
    assert not any(n.endswith(".tmp") or n in fresh for n in leftovers), leftovers


def overlaps(spans, buffers) -> bool:
    """Whether any (address, nbytes, ...) span overlaps one of ``buffers``."""
    return any(s[0] < b.ctypes.data + b.nbytes and b.ctypes.data < s[0] + s[1]
               for s in spans for b in buffers)


def late_transfers_leave_caller_buffers_alone(b) -> list[str]:
    """Scenario: 1. NIXL accepts every request but runs none and reports it still
    running; 2. get (into sentinel-filled buffers) and put return misses, their
    requests parked; no parked job points into the caller's buffers; 3. the caller
    reuses its pages at once (overwrites the put's sources); 4. the parked requests
    now really run, late, and are reaped; 5. the get's buffers still hold the
    sentinel. Returns the keys of the put, which a late PutObject (OBJ) may store."""
    stored, fresh = keys(2), keys(2)
    assert b.put(stored, [obj(0), obj(1)]) == [True, True]
    agent, deferred = b._engine.agent, []
    real_transfer, real_check = agent.transfer, agent.check_xfer_state
    agent.transfer = lambda handle, *a: deferred.append(handle) or "PROC"
    agent.check_xfer_state = lambda handle: "PROC"
    targets = [[np.full(n, 0xA5, np.uint8) for n in (64, OBJECT_BYTES - 64)] for _ in stored]
    sentinel = [[t.copy() for t in target] for target in targets]
    sources = [obj(2), obj(3)]
    try:
        assert b.get(stored, targets) == [False, False]
        assert b.put(fresh, sources) == [False, False]
        caller = [buf for bufs in targets + sources for buf in bufs]
        parked = [span for _, group in b._engine._parked for job in group for span in job.local]
        assert len(parked) >= 4 and not overlaps(parked, caller)
    finally:
        agent.transfer, agent.check_xfer_state = real_transfer, real_check
    for buf in (buf for bufs in sources for buf in bufs):
        buf[:] = 0x5A  # the caller reuses the put's pages right away
    for handle in deferred:  # the late I/O
        real_transfer(handle)
    stop = time.monotonic() + 10
    while b.stats()["parked_transfers"] and time.monotonic() < stop:
        b._engine.reap()
        time.sleep(0.01)
    assert b.stats()["parked_transfers"] == 0 and len(deferred) >= 2
    assert all(same(t, s) for t, s in zip(targets, sentinel))
    return fresh


def test_late_transfers_never_touch_caller_buffers(tmp_path, built):
    b = built(posix_spec(tmp_path, timeout_s=0.3))
    fresh = late_transfers_leave_caller_buffers_alone(b)
    assert b.exists_prefix(fresh) == 0  # a put reported False is never published
    ks = keys(1)  # the agent and the staging slots still work
    target = empty()
    assert b.put(ks, [obj(7)]) == [True] and b.get(ks, [target]) == [True]
    assert same(target, obj(7))


# --- clear -------------------------------------------------------------------


def test_posix_clear_removes_objects_and_temp_files_only(tmp_path, built):
    b = built(posix_spec(tmp_path))
    ks = keys(3)
    b.put(ks, [obj(i) for i in range(3)])
    sub = os.path.dirname(b._store.object_path(ks[0]))
    stale = os.path.join(sub, f".{ks[0]}.1.2.3.tmp")
    open(stale, "wb").close()
    foreign = os.path.join(sub, "README.TXT")
    open(foreign, "wb").close()
    b.clear()
    assert b.exists_prefix(ks) == 0
    assert not os.path.exists(stale) and os.path.exists(foreign)
    assert b.put(ks[:1], [obj(0)]) == [True]
    shutil.rmtree(sub)  # a fan-out directory removed behind our back comes back
    assert b.put(ks[:1], [obj(1)]) == [True] and b.exists_prefix(ks[:1]) == 1


# --- start-up and options ------------------------------------------------------


def test_unwritable_path_at_start_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="nixl backend.*path=.*a-file"):
        make(posix_spec(blocker / "l3"))


def test_invalid_keys_are_misses(tmp_path, built):
    b = built(posix_spec(tmp_path))
    bad = ["../escape", ".hidden", "UPPER", "a/b", ""]
    assert b.put(bad, [obj(0) for _ in bad]) == [False] * len(bad)
    assert b.get(bad, [empty() for _ in bad]) == [False] * len(bad)
    assert b.exists_prefix(bad) == 0


def test_options_are_validated():
    with pytest.raises(ValueError, match="accepted"):
        NixlConfig.from_options({"path": "/x", "no_such_option": 1})
    with pytest.raises(ValueError, match="path"):
        NixlConfig.from_options({})
    with pytest.raises(ValueError, match=r"\['bucket'\] do not apply to plugin='POSIX'"):
        NixlConfig.from_options({"path": "/x", "bucket": "b"})
    with pytest.raises(ValueError, match="path.*do not apply to plugin='OBJ'"):
        NixlConfig.from_options({"plugin": "obj", "bucket": "b", "path": "/x"})
    with pytest.raises(ValueError, match="bucket"):
        NixlConfig.from_options({"plugin": "OBJ"})
    with pytest.raises(ValueError, match="plugin"):
        NixlConfig.from_options({"plugin": "UCX", "path": "/x"})
    with pytest.raises(ValueError, match="timeout_s"):
        NixlConfig.from_options({"path": "/x", "timeout_s": 0})
    with pytest.raises(ValueError, match="posix_backend_params"):
        NixlConfig.from_options({"path": "/x", "posix_backend_params": {"use_aio": [1]}})
    cfg = NixlConfig.from_options({"path": "/x", "posix_backend_params": {"use_uring": True}})
    assert cfg.plugin_params() == {"use_uring": "true"}


def test_secrets_never_shown():
    cfg = NixlConfig.from_options({"plugin": "OBJ", "bucket": "b", "access_key": "AKIA-SECRET",
                                   "secret_key": "s3cr3t"})
    assert "s3cr3t" not in repr(cfg) and "AKIA-SECRET" not in repr(cfg)
    with pytest.raises(ValueError) as err:
        NixlConfig.from_options({"plugin": "OBJ", "bucket": "b", "secret_key": 12345})
    assert "12345" not in str(err.value)


def test_missing_nixl_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)
    install = r"pip install --no-deps nixl==1\.5\.1 nixl-cu12==1\.5\.1"
    with pytest.raises(ImportError, match=install):
        make(posix_spec(tmp_path))
