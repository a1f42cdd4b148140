"""The micro-benchmarks (pytest-benchmark) import the benchmark scripts next to
this folder for their set-up, so that a script and its micro-benchmark measure
the same thing; this puts ``benchmarks/`` and the repository root on the path.

A regression found by ``--benchmark-compare-fail`` ends the run with exit
status 1 and one line under pytest-benchmark's list of the regressed
benchmarks, instead of the traceback of pytest-benchmark's exception (which
would bury the list).

Not collected by ``make test`` (``testpaths`` is ``tests``); run through
``benchmarks/micro/run.py`` (``make bench-micro``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pytest_benchmark.session import PerformanceRegression

BENCHMARKS = Path(__file__).resolve().parent.parent
for path in (BENCHMARKS, BENCHMARKS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.hookimpl(wrapper=True)
def pytest_terminal_summary(terminalreporter):
    try:
        return (yield)
    except PerformanceRegression:
        pytest.exit("micro-benchmarks REGRESSED past --benchmark-compare-fail: the benchmarks "
                    "are listed under 'Performance has regressed' above",
                    returncode=pytest.ExitCode.TESTS_FAILED)
