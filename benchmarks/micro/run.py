"""Run the micro-benchmarks, save the run, and compare it with the previous one.

    .venv/bin/python benchmarks/micro/run.py [--fail-over median:15%] [PYTEST ARGS...]

Every run is saved under ``.benchmarks/<machine>/`` (pytest-benchmark's
``--benchmark-autosave``; ``<machine>`` is OS, Python implementation, version
and word size, so runs of different interpreters are never compared). When an
earlier run of this machine is there, the run is compared with the latest one
and fails, naming each benchmark, where a statistic grew past ``--fail-over``
(pytest-benchmark's ``--benchmark-compare-fail`` syntax, e.g. ``median:15%``
or ``min:0.001``). The first run has nothing to compare with: it only saves,
and says so. ``--against NNNN`` compares with an earlier saved run instead of
the latest. Other arguments go to pytest (``--benchmark-min-rounds 3``).

Exit status: pytest's (1 on a regression or a failed benchmark); 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

try:
    from pytest_benchmark.utils import get_machine_id, parse_compare_fail
except ImportError:  # main() says what to install
    get_machine_id = parse_compare_fail = None

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SUITE = Path(__file__).resolve().parent


def machine_runs(storage: Path) -> list[Path]:
    """This machine's saved runs, oldest first (pytest-benchmark numbers them)."""
    return sorted((storage / get_machine_id()).glob("[0-9][0-9][0-9][0-9]_*.json"))


def threshold(text: str) -> str:
    """``text`` if pytest-benchmark accepts it as a --benchmark-compare-fail value.

    Checked here because the first run does not pass it to pytest, and a typo
    would otherwise surface only on the second."""
    parse_compare_fail(text)  # its ArgumentTypeError names the value
    return text


def pytest_command(suite: Path, storage: Path, fail_over: str, previous: Path | None,
                   extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", str(suite), "--benchmark-autosave",
               f"--benchmark-storage=file://{storage}",
               # Calibrated benchmarks stop at 0.3 s (5 rounds at least): the
               # suite stays near a minute; a later --benchmark-max-time wins.
               "--benchmark-max-time=0.3"]
    if previous is not None:
        # pytest-benchmark compares with the run of this number in its storage.
        command += [f"--benchmark-compare={previous.name[:4]}",
                    f"--benchmark-compare-fail={fail_over}"]
    return command + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    if parse_compare_fail is None:
        print("pytest-benchmark is not installed: .venv/bin/pip install -e '.[bench]'",
              file=sys.stderr)
        return 2
    parser.add_argument("--fail-over", type=threshold, default="median:15%",
                        help="regression threshold, as pytest-benchmark's --benchmark-compare-fail")
    parser.add_argument("--against", metavar="NNNN",
                        help="compare with this saved run of this machine, not the latest")
    parser.add_argument("--suite", type=Path, default=DEFAULT_SUITE,
                        help="folder of pytest-benchmark modules")
    parser.add_argument("--storage", type=Path, default=REPO / ".benchmarks",
                        help="where runs are saved")
    args, extra = parser.parse_known_args(argv)
    runs = machine_runs(args.storage)
    previous = runs[-1] if runs else None
    if args.against is not None:
        chosen = [run for run in runs if run.name.startswith(f"{args.against}_")]
        if not chosen:
            numbers = ", ".join(run.name[:4] for run in runs) or "none"
            parser.error(f"--against {args.against}: no such run of this machine in "
                         f"{args.storage} (saved runs: {numbers})")
        previous = chosen[0]
    if previous is None:
        print(f"micro-benchmarks: no earlier run of this machine in {args.storage}; this run is "
              "saved as the baseline and compared with nothing", flush=True)
    else:
        print(f"micro-benchmarks: comparing with {previous.name}; a benchmark regressing "
              f"past {args.fail_over} fails the run", flush=True)
    command = pytest_command(args.suite, args.storage, args.fail_over, previous, extra)
    return subprocess.call(command, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
