"""Behaviour every StorageBackend must show. A backend's test module defines a
class inheriting ``BackendConformance`` with two fixtures:

- ``spec`` -> (name, options): how ``create_backend`` builds it (also used to
  build it again in a second process);
- ``backend``: a fresh instance (e.g. ``make(spec)``), closed after the test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest

from vllm_hicache.storage import StorageContext, create_backend

OBJECT_BYTES = 64 + 4096


def make(spec, role: str = "worker"):
    name, options = spec
    return create_backend(name, options, StorageContext(role, 0, 1, OBJECT_BYTES))


def obj(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
    return [data[:64].copy(), data[64:].copy()]


def empty() -> list[np.ndarray]:
    return [np.zeros(64, np.uint8), np.zeros(OBJECT_BYTES - 64, np.uint8)]


def keys(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:12]
    return [f"hc1-test-{tag}-{i:04d}" for i in range(n)]


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


class BackendConformance:
    def test_round_trip_into_other_buffers(self, backend):
        ks, objs = keys(5), [obj(i) for i in range(5)]
        assert backend.put(ks, objs) == [True] * 5
        targets = [empty() for _ in ks]
        assert backend.get(ks, targets) == [True] * 5
        assert all(same(t, o) for t, o in zip(targets, objs))

    def test_exists_prefix_stops_at_first_miss(self, backend):
        ks = keys(4)
        backend.put([ks[0], ks[1], ks[3]], [obj(0), obj(1), obj(3)])
        assert backend.exists_prefix(ks) == 2
        assert backend.exists_prefix(ks[3:]) == 1
        assert backend.exists_prefix([]) == 0
        assert backend.exists_prefix(keys(2)) == 0

    def test_missing_key_is_a_miss_not_an_error(self, backend):
        ks = keys(2)
        backend.put(ks[:1], [obj(0)])
        targets = [empty(), empty()]
        assert backend.get(ks, targets) == [True, False]

    def test_size_mismatch_is_a_miss(self, backend):
        ks = keys(1)
        backend.put(ks, [obj(0)])
        bigger = [np.zeros(64, np.uint8), np.zeros(OBJECT_BYTES, np.uint8)]
        assert backend.get(ks, [bigger]) == [False]

    def test_overwrite_keeps_one_whole_object(self, backend):
        ks = keys(1)
        backend.put(ks, [obj(0)])
        backend.put(ks, [obj(1)])
        target = empty()
        assert backend.get(ks, [target]) == [True]
        assert same(target, obj(0)) or same(target, obj(1))

    def test_clear(self, backend):
        ks = keys(3)
        backend.put(ks, [obj(i) for i in range(3)])
        backend.clear()
        assert backend.exists_prefix(ks) == 0

    def test_threads_in_parallel(self, backend):
        errors = []

        def work(seed):
            try:
                ks = keys(8)
                objs = [obj(seed * 10 + i) for i in range(8)]
                assert backend.put(ks, objs) == [True] * 8
                targets = [empty() for _ in ks]
                assert backend.get(ks, targets) == [True] * 8
                assert all(same(t, o) for t, o in zip(targets, objs))
            except Exception as err:  # noqa: BLE001 - collected for the assert
                errors.append(err)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors

    def test_second_process_reads_what_first_wrote(self, spec, backend):
        ks = keys(3)
        assert backend.put(ks, [obj(i) for i in range(3)]) == [True] * 3
        script = textwrap.dedent(f"""
            import numpy as np
            from tests.storage.conformance import make, obj, empty, same
            b = make({spec!r})
            targets = [empty() for _ in range(3)]
            assert b.get({ks!r}, targets) == [True] * 3
            assert all(same(t, obj(i)) for i, t in enumerate(targets))
            b.put([{ks[0]!r} + "-child"], [obj(9)])
            b.close()
            print("ok")
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
        target = empty()
        assert backend.get([ks[0] + "-child"], [target]) == [True]
        assert same(target, obj(9))

    def test_scheduler_role_can_query(self, spec, backend):
        ks = keys(2)
        backend.put(ks, [obj(0), obj(1)])
        sched = make(spec, role="scheduler")
        try:
            assert sched.exists_prefix(ks) == 2
        finally:
            sched.close()

    def test_unknown_option_is_rejected(self, spec):
        name, options = spec
        with pytest.raises(ValueError, match="no_such_option"):
            make((name, {**options, "no_such_option": 1}))
