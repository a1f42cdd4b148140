"""The pure core (index/, policy/, planner/, config*.py, keys.py) imports neither torch nor vllm."""

import subprocess
import sys
import textwrap

PURE_MODULES = [
    "vllm_hicache",
    "vllm_hicache.config",
    "vllm_hicache.config_admin",
    "vllm_hicache.config_finish",
    "vllm_hicache.storage_config",
    "vllm_hicache.keys",
    "vllm_hicache.index",
    "vllm_hicache.policy",
    "vllm_hicache.policy.eviction",
    "vllm_hicache.policy.write",
    "vllm_hicache.policy.load",
    "vllm_hicache.policy.offload",
    # The option values config.py checks, owned by the packages that use them.
    "vllm_hicache.host.layout_names",
    "vllm_hicache.kernels.io_backends",
    # The capacity planner replays logs with the same tree and policies.
    "vllm_hicache.planner",
    "vllm_hicache.planner.log_format",
    "vllm_hicache.planner.l1",
    "vllm_hicache.planner.model",
    "vllm_hicache.planner.replay",
    "vllm_hicache.planner.reuse",
    "vllm_hicache.planner.report",
    "vllm_hicache.planner.plots",
    "vllm_hicache.planner.__main__",
    # The node tier: shared-memory pages and their index, pure Python.
    "vllm_hicache.node",
]


def test_pure_core_imports_without_torch_or_vllm():
    script = textwrap.dedent(
        f"""
        import importlib, sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "vllm", "numpy"):
                    raise ImportError("blocked: " + name)
                return None

        sys.meta_path.insert(0, Block())
        for mod in {PURE_MODULES!r}:
            importlib.import_module(mod)
        loaded = [m for m in sys.modules if m.split(".")[0] in ("torch", "vllm")]
        assert not loaded, loaded
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_blocker_actually_blocks():
    """Negative control: the same harness fails on a module that needs torch."""
    script = textwrap.dedent(
        """
        import importlib, sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "vllm"):
                    raise ImportError("blocked: " + name)
                return None

        sys.meta_path.insert(0, Block())
        importlib.import_module("vllm_hicache.connector.connector")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode != 0
    assert "blocked" in out.stderr
