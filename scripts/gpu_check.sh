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
# and writes gpu-report.md (format: docs/cuda.md).
# Without a CUDA device it still runs both suites (the GPU tests all skip,
# the kernel tests run in Triton's interpreter), writes the report saying
# so, and exits 2: nothing about the GPU was proven.
# Exit status: 0 all passed on a GPU, 1 something failed, 2 no CUDA device
# (or no usable Python/torch/pytest: then no report).
#
#   PYTHON=python3.12 scripts/gpu_check.sh       another interpreter
#   GPU_CHECK_PYTEST_ARGS="-k overlap" ...        narrow the GPU tests
#   GPU_CHECK_BENCH_ARGS="..."                    arguments of the benchmark
#   GPU_CHECK_REPORT=path ...                     where the report goes (./gpu-report.md)
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
if importlib.util.find_spec("pytest") is None:
    print("pytest is not installed", file=sys.stderr)
    sys.exit(4)


def version(name):
    if importlib.util.find_spec(name) is None:
        return "absent"
    module = __import__(name)
    return getattr(module, "__version__", "present")


if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"device:   {props.name} (sm_{props.major}{props.minor}, "
          f"{props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} visible")
else:
    print("device:   none (torch.cuda.is_available() is False): the GPU tests skip")
print(f"software: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), triton {version('triton')}, "
      f"vllm {version('vllm')}")
EOF
case $? in
  0) ;;
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
"$py" scripts/gpu_report.py "$work" "${GPU_CHECK_REPORT:-$repo/gpu-report.md}"
