"""The data path runs where vLLM is not installed (a GPU machine lent for
scripts/gpu_check.sh): it, and the tests that drive it there, import no vllm.
And the script itself parses, and refuses clearly without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

# What gpu_check.sh imports on a machine without vLLM.
NO_VLLM_MODULES = [
    "vllm_hicache.datapath",
    "vllm_hicache.datapath.pipeline",
    "vllm_hicache.datapath.async_loads",
    "vllm_hicache.common.jobs",
    "tests.datapath.rig",
    "tests.datapath.scenarios",
    "tests.gpu.conftest",
    "tests.gpu.test_data_path",
]

BLOCKER = """
import importlib, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ImportError("blocked: " + name)
        return None

sys.meta_path.insert(0, Block())
"""


def _run(body: str) -> subprocess.CompletedProcess:
    script = BLOCKER + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_data_path_imports_without_vllm():
    out = _run(f"""
        for mod in {NO_VLLM_MODULES!r}:
            importlib.import_module(mod)
        loaded = [m for m in sys.modules
                  if m.split(".")[0] == "vllm" or m.startswith("vllm_hicache.connector")]
        assert not loaded, loaded
        print("ok")
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_blocker_blocks_vllm():
    """Negative control: the worker half (vLLM glue) fails under the blocker."""
    out = _run("importlib.import_module('vllm_hicache.connector.worker')")
    assert out.returncode != 0
    assert "blocked: vllm" in out.stderr


def test_gpu_check_parses_and_is_executable():
    assert os.access(SCRIPT, os.X_OK)
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_gpu_check_refuses_without_python():
    env = {**os.environ, "PYTHON": "/nonexistent/python"}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 2
    assert "no Python interpreter" in out.stderr
