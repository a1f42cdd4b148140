"""benchmarks/bench_engine_turnaround.py measures what it says: the steps
are handed over and timed, and its backups really write through the product's
background pool, yielding the core after each object only when asked to."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_engine_turnaround as bench  # noqa: E402


def args(**overrides) -> argparse.Namespace:
    base = dict(step_ms=2.0, schedule_ms=0.5, objects=5, object_bytes=4096, every_ms=1.0,
                seconds=0.5, reps=1, dir=None)
    return argparse.Namespace(**{**base, **overrides})


@pytest.mark.parametrize("yields", [True, False])
def test_backups_write_every_object_through_a_background_pool(tmp_path, monkeypatch, yields):
    calls = []
    monkeypatch.setattr(bench.os, "sched_yield", lambda: calls.append(1))
    stop = mp.Event()
    store = tmp_path / "store"
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    bench.backups(None, args(), str(store), yields, stop)
    files = list(store.glob("*/*/*.hckv"))
    assert files and len(files) % 5 == 0
    assert {f.stat().st_size for f in files} == {bench.HEADER_BYTES + 4096}
    assert (len(calls) == len(files)) if yields else not calls


@pytest.mark.skipif(len(bench.os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_run_hands_steps_over_and_times_them(tmp_path):
    steps, delays_ms = bench.run("backups", args(), str(tmp_path))
    assert steps > 10 and len(delays_ms) == steps
    assert (delays_ms >= 0).all() and (delays_ms < 5000).all()
