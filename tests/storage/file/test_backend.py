"""The ``file`` backend: conformance, plus what only a directory can get wrong
(path escapes, partial and wrong-length files, several processes at once).
Capacity (max_bytes) is in test_capacity.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.storage.conformance import (
    OBJECT_BYTES,
    BackendConformance,
    empty,
    keys,
    make,
    obj,
    same,
)
from tests.storage.file import stress as file_stress
from tests.storage.file.fixtures import backend, build, object_files, root, spec  # noqa: F401
from vllm_hicache.storage.file import backend as file_module
from vllm_hicache.storage.file import io as file_io

REPO = Path(__file__).resolve().parents[3]


class TestFileConformance(BackendConformance):
    pass


# --- keys never escape the directory ---

BAD_KEYS = ["../x", "a/b", "/etc/passwd", "..", ".", "", "x.y", "Key", "a\x00b",
            "k" * 201, "a b", "~root"]


def test_bad_keys_are_misses_and_write_nothing(tmp_path, backend, root):
    before = set(tmp_path.rglob("*"))
    assert backend.put(BAD_KEYS, [obj(i) for i in range(len(BAD_KEYS))]) == [False] * len(BAD_KEYS)
    assert backend.get(BAD_KEYS, [empty() for _ in BAD_KEYS]) == [False] * len(BAD_KEYS)
    assert [backend.exists_prefix([key]) for key in BAD_KEYS] == [0] * len(BAD_KEYS)
    assert set(tmp_path.rglob("*")) == before
    assert not (tmp_path / "x").exists() and not Path("/x").exists()
    ks = keys(2)
    backend.put(ks, [obj(0), obj(1)])
    assert backend.exists_prefix([ks[0], "../" + ks[1], ks[1]]) == 1


def test_layout_is_fanout_of_key_hash(backend, root):
    ks = keys(3)
    backend.put(ks, [obj(i) for i in range(3)])
    for key in ks:
        path = Path(file_io.object_path(str(root), key))
        assert path.is_file() and path.parent.parent.parent == root
        assert path.stat().st_size == OBJECT_BYTES
        assert path.read_bytes() == b"".join(o.tobytes() for o in obj(ks.index(key)))


# --- short, long and partial files ---

@pytest.mark.parametrize("new_size", [0, OBJECT_BYTES - 1, OBJECT_BYTES + 1])
def test_wrong_length_file_is_a_miss(backend, root, new_size):
    ks = keys(2)
    backend.put(ks, [obj(0), obj(1)])
    os.truncate(file_io.object_path(str(root), ks[0]), new_size)
    targets = [empty(), empty()]
    assert backend.get(ks, targets) == [False, True]
    assert same(targets[1], obj(1))


def test_temp_files_are_not_objects(backend, root):
    key = keys(1)[0]
    final = file_io.object_path(str(root), key)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    Path(os.path.dirname(final), f".{key}.{'0' * 16}.tmp").write_bytes(b"x" * OBJECT_BYTES)
    assert backend.exists_prefix([key]) == 0
    assert backend.get([key], [empty()]) == [False]
    backend.clear()
    assert list(Path(os.path.dirname(final)).iterdir()) == []


def test_clear_keeps_foreign_files(backend, root):
    ks = keys(2)
    backend.put(ks, [obj(0), obj(1)])
    leaf = Path(file_io.object_path(str(root), ks[0])).parent
    foreign = [root / "notes.txt", leaf / "other.bin", leaf / "UPPER.hckv"]
    for f in foreign:
        f.write_bytes(b"mine")
    backend.clear()
    assert backend.exists_prefix(ks) == 0 and object_files(root) == [foreign[2]]
    assert all(f.read_bytes() == b"mine" for f in foreign)


def test_multi_buffer_objects_of_odd_sizes(build):
    b = build(num_io_threads=3)
    rng = np.random.default_rng(7)
    sizes = [64, 1_000_003, 5]
    srcs = [[rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] for _ in range(7)]
    ks = keys(7)
    assert b.put(ks, srcs) == [True] * 7
    targets = [[np.zeros(n, np.uint8) for n in sizes] for _ in range(7)]
    assert b.get(ks, targets) == [True] * 7
    assert all(same(t, s) for t, s in zip(targets, srcs))
    assert b.stats()["get_bytes"] == 7 * sum(sizes)


@pytest.mark.parametrize("options", [{"num_io_threads": 1}, {"num_io_threads": 2},
                                     {"max_bytes": 1 << 20}])
def test_fsync_round_trip(build, options):
    b = build(fsync=True, **options)
    ks = keys(4)
    assert b.put(ks, [obj(i) for i in range(4)]) == [True] * 4
    targets = [empty() for _ in ks]
    assert b.get(ks, targets) == [True] * 4
    assert all(same(t, obj(i)) for i, t in enumerate(targets))


def test_closed_backend_misses(spec):
    b = make(spec)
    ks = keys(1)
    b.put(ks, [obj(0)])
    b.close()
    b.close()
    assert b.get(ks, [empty()]) == [False] and b.put(ks, [obj(1)]) == [False]
    assert b.exists_prefix(ks) == 0


def test_reader_never_sees_a_partial_object(backend, monkeypatch):
    """Scenario: 1. put v0; 2. a second put of v1 stops after writing its
    header (a short write); 3. a get meanwhile reads v0 whole; 4. the put
    resumes the short write; 5. a get reads v1 whole."""
    ks = keys(1)
    backend.put(ks, [obj(0)])
    real_writev, halfway, resume = os.writev, threading.Event(), threading.Event()

    def header_then_wait(fd, buffers):
        done = real_writev(fd, buffers[:1])
        halfway.set()
        resume.wait(10)
        return done

    monkeypatch.setattr(os, "writev", header_then_wait)
    writer = threading.Thread(target=lambda: backend.put(ks, [obj(1)]))
    writer.start()
    assert halfway.wait(10)
    target = empty()
    assert backend.get(ks, [target]) == [True] and same(target, obj(0))
    resume.set()
    writer.join(10)
    monkeypatch.undo()
    assert backend.get(ks, [target]) == [True] and same(target, obj(1))


def test_short_reads_are_resumed(backend, monkeypatch):
    ks = keys(1)
    backend.put(ks, [obj(3)])
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_preadv(fd, bufs[:1], off))
    target = empty()
    assert backend.get(ks, [target]) == [True] and same(target, obj(3))


# --- options and start-up ---

def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = blocker / "l3"
    with pytest.raises(ValueError, match=f"file backend.*{path}"):
        make(("file", {"path": str(path)}))


@pytest.mark.parametrize("option, value", [
    ("max_bytes", -1), ("max_bytes", "1GB"), ("max_bytes", True), ("num_io_threads", 0),
    ("num_io_threads", 1.5), ("fsync", "yes"), ("path", ""), ("path", 3),
])
def test_bad_option_names_its_key(root, option, value):
    with pytest.raises(ValueError, match=option):
        make(("file", {"path": str(root), option: value}))


def test_default_path_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    b = make(("file", {}))
    b.close()
    assert b.root == str(tmp_path / "xdg" / "vllm_hicache" / "l3") and os.path.isdir(b.root)


# --- several processes ---

@pytest.mark.parametrize("max_objects", [0, 6])
def test_two_processes_stress_overlapping_keys(root, max_objects):
    """Two writers/readers on 8 shared keys (tests/storage/file/stress.py); with
    a capacity of 6 objects they also evict what the other may be reading.
    Every hit must be byte-exact."""
    spec = ("file", {"path": str(root), "max_bytes": max_objects * file_stress.OBJECT_BYTES})
    procs = [subprocess.Popen([sys.executable, "-m", "tests.storage.file.stress", repr(spec),
                               str(w), "1000"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in (1, 2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("ok"), err[-3000:]
        assert int(out.split()[1]) > 0
    if max_objects:
        stored = sum(p.stat().st_size for p in object_files(root))
        assert stored <= max_objects * file_stress.OBJECT_BYTES


def test_hung_directory_fails_start_in_time(root, monkeypatch):
    monkeypatch.setattr(file_module, "_STARTUP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(file_module, "_probe_writable", lambda *args: time.sleep(2))
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"file backend.*{root}.*did not answer"):
        make(("file", {"path": str(root)}))
    assert time.monotonic() - start < 1.5


def test_a_put_from_a_background_thread_runs_on_it_alone(build, monkeypatch):  # noqa: F811
    """A backup's put runs in the background (l3/worker_io.BACKUPS): its
    batch is not fanned out to helper threads at the engine's priority
    (storage/batching.map_slices); a put from another thread still is."""
    from vllm_hicache.daemon_pool import DaemonPool
    from vllm_hicache.io_threads import Background

    b = build(num_io_threads=3)
    seen: list[str] = []
    put_one = b._put_one

    def watched(key, buffers):
        seen.append(threading.current_thread().name)
        return put_one(key, buffers)

    monkeypatch.setattr(b, "_put_one", watched)
    data = [[np.full(64, i, np.uint8)] for i in range(6)]
    caller = DaemonPool(1, "test-bg", Background(nice=4, patience_s=60.0))
    try:
        put = caller.submit(b.put, [f"bg-{i}" for i in range(6)], data)
        assert put.result(timeout=10) == [True] * 6
    finally:
        caller.shutdown()
    assert seen == ["test-bg-0"] * 6
    seen.clear()
    assert b.put([f"fg-{i}" for i in range(6)], data) == [True] * 6
    assert {name.rsplit("-", 1)[0] for name in seen} == {"MainThread", "hicache-file"}
