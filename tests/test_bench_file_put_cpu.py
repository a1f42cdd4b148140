"""benchmarks/bench_file_put_cpu.py writes what it times: every object a new
file of header + payload, CPU per object positive."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_file_put_cpu  # noqa: E402


def test_a_run_writes_every_object_once_and_reports_cpu_per_object(tmp_path):
    args = argparse.Namespace(objects=30, object_bytes=1024, batch=7)
    store = tmp_path / "store"
    per_object_s = bench_file_put_cpu.run_once(str(store), args, "t", threads=2)
    files = sorted(store.glob("*/*/*.hckv"))
    assert len(files) == 31  # + the untimed object that starts the pool
    assert {f.stat().st_size for f in files} == {bench_file_put_cpu.HEADER_BYTES + 1024}
    assert 0 < per_object_s < 1.0
