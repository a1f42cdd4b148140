"""scripts/gpu_check.sh and its report (scripts/gpu_report.py).

On this CPU machine the script must run both suites with every GPU test
skipped cleanly, write the report and exit 2 (nothing about a GPU proven);
the report's verdicts and overlap figures are checked on synthetic results
of a GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_report  # noqa: E402


def test_script_on_cpu_skips_cleanly_and_writes_the_report(tmp_path):
    report = tmp_path / "gpu-report.md"
    # No device visible even on a GPU machine: this is the CPU-only contract.
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_REPORT=str(report),
               CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([str(REPO / "scripts" / "gpu_check.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == gpu_report.EXIT_NO_CUDA, out.stdout[-3000:] + out.stderr[-3000:]
    text = report.read_text()
    assert "**Overall: NO GPU: suites ran, GPU tests skipped**" in text
    assert "| gpu_tests | skipped cleanly (no CUDA device) | 0 | 0 | 0 |" in text
    assert "| kernel_tests | PASS |" in text
    gpu_cases = text.split("## Tests: gpu_tests")[1].split("## Tests: kernel_tests")[0]
    outcomes = [line.rsplit("|", 2)[1].strip() for line in gpu_cases.splitlines()
                if line.startswith("| `")]
    assert len(outcomes) > 50 and set(outcomes) == {"skip"}


def _gpu_run(work: Path, *, gpu_rc: int = 0, failed: bool = False) -> None:
    (work / "env.txt").write_text("device:   NVIDIA H200 (sm_90, 139 GiB), 1 visible\n"
                                  "software: python 3.12\n")
    case = '<testcase classname="tests.gpu.t" name="test_a">{}</testcase>'.format(
        '<failure message="x"/>' if failed else "")
    for name, rc in (("gpu_tests", gpu_rc), ("kernel_tests", 0)):
        (work / f"{name}.xml").write_text(
            f'<testsuites><testsuite tests="1" failures="{int(failed and name == "gpu_tests")}" '
            f'errors="0" skipped="0">{case if name == "gpu_tests" else ""}'
            "</testsuite></testsuites>")
        (work / f"{name}.rc").write_text(str(rc))
    record = {"io_backend": "kernel", "mem_layout": "layer_first", "compute_fraction": 1.0,
              "layer_mib": 32.0, "layer_load_ms": 1.0, "loaded": [1.0] * 8,
              "step_ms": 9.0, "serial_ms": 16.0}
    (work / "timeline.jsonl").write_text(json.dumps(record) + "\n")
    (work / "bench.log").write_text("device: NVIDIA H200\n| 16 | page_first | kernel | D2H |\n")
    (work / "bench.rc").write_text("0")


def test_report_of_a_passing_gpu_run(tmp_path):
    _gpu_run(tmp_path)
    rc, text = gpu_report.render(tmp_path)
    assert rc == 0 and "**Overall: PASS**" in text
    # 8 layers of 1 ms loads; overlapped 9 ms against 16 back to back: 7 of 8 ms hidden
    assert "| kernel | layer_first | 1.0 | 8 | 32 | 1.000 | 9.000 | 16.000 | 88% |" in text
    assert "| 16 | page_first | kernel | D2H |" in text
    assert "| `tests.gpu.t::test_a` | pass |" in text


def test_report_of_a_failing_gpu_run(tmp_path):
    _gpu_run(tmp_path, gpu_rc=1, failed=True)
    rc, text = gpu_report.render(tmp_path)
    assert rc == 1 and "**Overall: FAIL**" in text
    assert "| `tests.gpu.t::test_a` | FAIL |" in text


def test_all_skipped_on_a_gpu_machine_is_a_failure(tmp_path):
    _gpu_run(tmp_path)
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="1" failures="0" errors="0" skipped="1">'
        '<testcase classname="t" name="a"><skipped/></testcase></testsuite></testsuites>')
    rc, text = gpu_report.render(tmp_path)
    assert rc == 1 and "every test was skipped on a CUDA machine" in text
