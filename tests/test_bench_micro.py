"""benchmarks/micro/run.py: the first run saves a baseline and compares with
nothing; a later run compares with the previous one (or the one named by
``--against``); a benchmark slower than the threshold fails the run, named,
without a traceback; a threshold pytest-benchmark would not accept, or a run
that is not saved, is refused before anything runs.

The suite here is one benchmark of a sleep whose length comes from the
environment, next to a copy of the micro suite's conftest (which turns the
regression into an exit status).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "benchmarks" / "micro" / "run.py"

SLEEP_BENCHMARK = '''
import os
import time


def test_sleep(benchmark):
    benchmark.pedantic(time.sleep, args=(float(os.environ["BENCH_SLEEP_S"]),), rounds=3)
'''


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(REPO / "benchmarks" / "micro" / "conftest.py", suite / "conftest.py")
    (suite / "test_sleep_bench.py").write_text(SLEEP_BENCHMARK)
    return suite


def run(suite: Path, sleep_s: float, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, BENCH_SLEEP_S=str(sleep_s))
    return subprocess.run(
        [sys.executable, str(RUNNER), "--suite", str(suite),
         "--storage", str(suite.parent / "runs"), *args, "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, timeout=300)


def test_first_run_saves_then_compares_then_flags_a_regression(suite: Path) -> None:
    first = run(suite, 0.01)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "no earlier run of this machine" in first.stdout
    assert len(list((suite.parent / "runs").glob("*/0001_*.json"))) == 1

    same = run(suite, 0.01, "--fail-over", "median:100%")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "comparing with 0001_" in same.stdout

    slower = run(suite, 0.1, "--fail-over", "median:100%")
    out = slower.stdout + slower.stderr
    assert slower.returncode == 1, out
    assert "comparing with 0002_" in out
    assert "Performance has regressed" in out and "test_sleep" in out
    assert "REGRESSED past --benchmark-compare-fail" in out
    assert "Traceback" not in out

    against = run(suite, 0.01, "--fail-over", "median:100%", "--against", "0001")
    assert against.returncode == 0, against.stdout + against.stderr
    assert "comparing with 0001_" in against.stdout

    missing = run(suite, 0.01, "--against", "0042")
    assert missing.returncode == 2
    assert "--against 0042: no such run" in missing.stderr
    assert "saved runs: 0001, 0002, 0003, 0004" in missing.stderr


def test_bad_threshold_is_refused_before_running(suite: Path) -> None:
    result = run(suite, 0.01, "--fail-over", "median:fast")
    assert result.returncode == 2
    assert "median:fast" in result.stderr
    assert not (suite.parent / "runs").exists()
