"""benchmarks/bench_read_beside_forward.py measures what it says: each
iteration's read is a whole layered read of the hit, run beside one forward
whose layer i waits for the read's layer i, and the main thread's lock waits
are its own context switches."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_read_beside_forward as bench  # noqa: E402


def args(tmp_path, **overrides) -> argparse.Namespace:
    base = dict(dir=str(tmp_path), iterations=3, pages=4, layers=2, ops=2, rows=4)
    return argparse.Namespace(**{**base, **overrides})


def test_each_iteration_reads_the_whole_hit_beside_one_forward(tmp_path):
    a = args(tmp_path)
    store, hashes, targets = bench.build_store(str(tmp_path), a.pages)
    reads = []
    real = store.read_by_layer

    def counted(*call_args):
        reads.append(threading.current_thread().name)
        return real(*call_args)

    store.read_by_layer = counted
    reader = bench.Reader(store, hashes, targets, sorted(bench.os.sched_getaffinity(0))[0])
    reader.start()
    alone = bench.measure(reader, a, with_read=False)
    assert reads == [] and alone.read_s == 0.0
    both = bench.measure(reader, a, with_read=True)
    assert reads == ["bench-reader"] * a.iterations and both.read_s > 0
    alone_read = bench.read_alone(reader, 2)
    assert 0 < alone_read.first_layer_s <= alone_read.read_s
    assert len(reads) == a.iterations + 2
    store.backend.close()


def test_a_short_read_is_an_error_not_a_number(tmp_path):
    a = args(tmp_path)
    store, hashes, targets = bench.build_store(str(tmp_path), a.pages)
    reader = bench.Reader(store, hashes[:2] + [b"\0" * 32] * 2, targets, 0)
    reader.start()
    with pytest.raises(SystemExit, match="read 2 of 4 pages"):
        bench.measure(reader, a, with_read=True)
    store.backend.close()


def test_the_forward_s_layer_waits_for_the_read_s_layer(tmp_path):
    a = args(tmp_path, layers=3)
    store, hashes, targets = bench.build_store(str(tmp_path), a.pages)
    order: list[str] = []
    real = store.read_by_layer

    def slow_layers(hashes_, targets_, on_layer):
        def late(layer, n):
            bench.time.sleep(0.02)
            order.append(f"read {layer}")
            on_layer(layer, n)
        return real(hashes_, targets_, late)

    store.read_by_layer = slow_layers
    reader = bench.Reader(store, hashes, targets, sorted(bench.os.sched_getaffinity(0))[0])
    reader.start()
    real_wait = reader.wait_layer
    reader.wait_layer = lambda layer: (real_wait(layer), order.append(f"forward {layer}"))
    reader.start_read()
    bench.forward(bench.torch.randn(2, bench.WIDTH), bench.torch.randn(bench.WIDTH, bench.WIDTH),
                  a.layers, 1, reader)
    reader.done.acquire()
    for layer in range(a.layers):
        assert order.index(f"read {layer}") < order.index(f"forward {layer}")
    store.backend.close()


def test_the_voluntary_switches_are_the_calling_thread_s():
    before = bench.voluntary_switches()
    threading.Event().wait(0.01)  # blocks: one voluntary switch at least
    assert bench.voluntary_switches() > before
