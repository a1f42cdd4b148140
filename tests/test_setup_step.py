"""The quiet set-up: scripts/setup_step.sh and the Makefile's use of it.

A stage prints one line; its command's output goes to the log, and comes to
the terminal only on failure (the log's tail) or with VERBOSE=1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP = REPO / "scripts" / "setup_step.sh"


def _step(tmp_path: Path, *command: str, verbose: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "SETUP_LOG": str(tmp_path / "logs" / "setup.log"),
           "SETUP_TAIL_LINES": "3", "VERBOSE": verbose}
    return subprocess.run([str(STEP), *command], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_stage_is_one_line_and_its_output_goes_to_the_log(tmp_path):
    res = _step(tmp_path, "fake stage", "sh", "-c",
                "for i in 1 2 3 4 5; do echo pip-line-$i; done")
    assert res.returncode == 0
    assert res.stdout.count("\n") == 1, res.stdout
    assert res.stdout.startswith("setup: fake stage ...") and " ok " in res.stdout
    assert len(res.stdout.rstrip("\n")) <= 80
    assert "pip-line" not in res.stdout + res.stderr
    log = (tmp_path / "logs" / "setup.log").read_text()
    assert "=== fake stage: sh -c" in log and "pip-line-5" in log


def test_a_failed_stage_shows_the_logs_tail_and_its_exit_status(tmp_path):
    res = _step(tmp_path, "broken", "sh", "-c",
                "echo early; echo a; echo b; echo why-it-broke; exit 7")
    assert res.returncode == 7
    assert "FAILED (exit status 7)" in res.stdout
    assert "why-it-broke" in res.stderr and "early" not in res.stderr  # the last 3 lines only
    assert "setup.log" in res.stderr


def test_verbose_shows_the_output_and_still_logs_it(tmp_path):
    res = _step(tmp_path, "loud", "sh", "-c", "echo pip-says-hi", verbose="1")
    assert res.returncode == 0
    assert "pip-says-hi" in res.stdout
    assert "pip-says-hi" in (tmp_path / "logs" / "setup.log").read_text()


def test_verbose_0_is_quiet(tmp_path):
    res = _step(tmp_path, "quiet", "sh", "-c", "echo pip-says-hi", verbose="0")
    assert "pip-says-hi" not in res.stdout


def test_a_missing_command_is_a_usage_error(tmp_path):
    res = _step(tmp_path, "label only")
    assert res.returncode == 2 and "usage" in res.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_with_the_stamp_present_prints_nothing(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".hicache-installed").touch()  # newer than pyproject.toml
    res = subprocess.run(["make", "--no-print-directory", "setup", f"VENV={venv}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr == ""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_runs_every_install_command_through_the_step_wrapper():
    res = subprocess.run(["make", "-n", "-B", "setup", "VENV=/nonexistent/venv"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # Each pip command is the argument of a setup_step.sh call (continuation lines joined).
    text = " ".join(res.stdout.replace("\\\n", " ").split())
    for cmd in ('install -e ".[cpu,redis,mooncake,test,bench]"',
                'install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"',
                "uninstall -y torchvision torchaudio torchcodec",
                'install "triton==3.9.0"',
                'install -e ".[cuda,redis,mooncake-cuda,test,bench]" "nixl==1.5.1"'):
        pip = re.escape(f"/nonexistent/venv/bin/python -m pip {cmd}")
        assert re.search(r'setup_step\.sh "[^"]+" ' + pip, text), (cmd, text)
