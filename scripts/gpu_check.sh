#!/usr/bin/env bash
# The CUDA data path, checked on a GPU machine that has no vLLM (issue 14).
#
# Runs from a plain copy of the repository: nothing is installed, the
# package is found through PYTHONPATH. Needs a Python with torch (CUDA),
# triton, numpy and pytest. Runs
#   1. tests/gpu      the data path (KVDataPath) with CUDA KV tensors in vLLM's
#                     GPU layouts: bytes, per-layer ordering, overlap, failures
#   2. tests/kernels  the copy backends: compiled Triton on the GPU, and the
#                     interpreter tests on the CPU
#   3. benchmarks/gpu_transfer.py, if the file exists
# and prints a short report. Exit status: 0 all passed, 1 something failed,
# 2 refused (no CUDA device, or no usable Python/torch/pytest).
#
#   PYTHON=python3.12 scripts/gpu_check.sh       another interpreter
#   GPU_CHECK_PYTEST_ARGS="-k overlap" ...        narrow the GPU tests
#   GPU_CHECK_BENCH_ARGS="..."                    arguments of the benchmark
#   GPU_CHECK_OUT=dir ...                         keep junit XML, timelines, logs
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
py=${PYTHON:-python3}

refuse() {
  echo "gpu_check: refused: $*" >&2
  exit 2
}

command -v "$py" >/dev/null 2>&1 || refuse "no Python interpreter '$py' (set PYTHON)"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || refuse "cannot create a temporary directory"
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1
export HICACHE_GPU_REPORT="$work/timeline.jsonl"
# The GPU tests need compiled kernels; the kernel tests' fixture sets it where wanted.
unset TRITON_INTERPRET

# --- the machine ------------------------------------------------------------------
"$py" - >"$work/env.txt" 2>"$work/env.err" <<'EOF'
import importlib.util
import sys

try:
    import torch
except Exception as err:  # noqa: BLE001
    print(f"torch cannot be imported: {err!r}", file=sys.stderr)
    sys.exit(4)
if not torch.cuda.is_available():
    sys.exit(3)
if importlib.util.find_spec("pytest") is None:
    print("pytest is not installed", file=sys.stderr)
    sys.exit(4)


def version(name):
    if importlib.util.find_spec(name) is None:
        return "absent"
    module = __import__(name)
    return getattr(module, "__version__", "present")


props = torch.cuda.get_device_properties(0)
print(f"device:   {props.name} (sm_{props.major}{props.minor}, "
      f"{props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} visible")
print(f"software: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), triton {version('triton')}, "
      f"vllm {version('vllm')}")
EOF
case $? in
  0) ;;
  3) refuse "no CUDA device visible to $py (torch.cuda.is_available() is False); run this on a GPU machine" ;;
  *) refuse "$py cannot run the checks: $(tail -n 1 "$work/env.err")" ;;
esac
cat "$work/env.txt"

# --- tests --------------------------------------------------------------------------
# The project's addopts name pytest-timeout, which such a machine may lack.
pytest_opts=(-q -o "addopts=" -p no:cacheprovider -rfEs)
if "$py" -c "import pytest_timeout" >/dev/null 2>&1; then
  pytest_opts+=(--timeout=600)
fi

run_suite() {  # name, paths and options...
  local name=$1
  shift
  echo
  echo "== $name: pytest $*"
  "$py" -m pytest "${pytest_opts[@]}" --junitxml="$work/$name.xml" "$@"
  echo $? >"$work/$name.rc"
}

# shellcheck disable=SC2086  # word splitting of the extra options is wanted
run_suite gpu_tests tests/gpu ${GPU_CHECK_PYTEST_ARGS:-}
run_suite kernel_tests tests/kernels

# --- benchmark ---------------------------------------------------------------------
if [ -f benchmarks/gpu_transfer.py ]; then
  echo
  echo "== benchmark: benchmarks/gpu_transfer.py ${GPU_CHECK_BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  timeout 600 "$py" benchmarks/gpu_transfer.py ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee "$work/bench.log"
  echo "${PIPESTATUS[0]}" >"$work/bench.rc"
fi

if [ -n "${GPU_CHECK_OUT:-}" ]; then
  mkdir -p "$GPU_CHECK_OUT" && cp "$work"/*.xml "$work"/*.txt "$GPU_CHECK_OUT"/ 2>/dev/null
  cp "$work"/timeline.jsonl "$work"/bench.log "$GPU_CHECK_OUT"/ 2>/dev/null
fi

# --- report ------------------------------------------------------------------------
echo
"$py" - "$work" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

work = Path(sys.argv[1])
print("== gpu_check report")
print((work / "env.txt").read_text().rstrip())
ok = True
for name in ("gpu_tests", "kernel_tests"):
    rc = int((work / f"{name}.rc").read_text())
    counts, failed = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}, []
    try:
        root = ET.parse(work / f"{name}.xml").getroot()
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    except (OSError, ET.ParseError):
        pass
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    verdict = "PASS" if rc == 0 else ("FAIL (no tests collected)" if rc == 5 else "FAIL")
    if name == "gpu_tests" and rc == 0 and passed == 0:
        rc, verdict = 1, "FAIL (every test was skipped: see the reasons above)"
    ok &= rc == 0
    print(f"{name + ':':14s}{verdict}: {passed} passed, {counts['failures']} failed, "
          f"{counts['errors']} errors, {counts['skipped']} skipped")
    for test in failed[:10]:
        print(f"    failed: {test}")
    if len(failed) > 10:
        print(f"    ... and {len(failed) - 10} more")
timeline = work / "timeline.jsonl"
for line in timeline.read_text().splitlines() if timeline.exists() else []:
    r = json.loads(line)
    print(f"overlap {r['io_backend']}/{r['mem_layout']}: {len(r['loaded'])} layers x "
          f"{r['layer_mib']:.0f} MiB, load {r['layer_load_ms']:.3f} ms/layer, "
          f"step {r['step_ms']:.3f} ms vs {r['serial_ms']:.3f} ms back to back")
bench_rc = work / "bench.rc"
if bench_rc.exists():
    rc = int(bench_rc.read_text())
    ok &= rc == 0
    print(f"{'benchmark:':14s}{'PASS' if rc == 0 else f'FAIL (exit {rc})'} "
          "(benchmarks/gpu_transfer.py; its output is above)")
else:
    print(f"{'benchmark:':14s}benchmarks/gpu_transfer.py not present: skipped")
print(f"{'overall:':14s}{'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
