"""Shared fixtures: config builders, the local tiny model, a tmpfs
directory for a node tier, the close of every connector harness a test
made (its threads would otherwise run, and probe stores, for the rest of the
session), and a check that no module leaves a ticking thread behind."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.threads import ticking_threads_outliving
from tests.tmpfs import tmpfs_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))


@pytest.fixture(autouse=True)
def _close_harnesses() -> Iterator[None]:
    yield
    # Only where a test imported it: pure tests never load vLLM for this.
    harness = sys.modules.get("tests.connector.harness")
    if harness is not None:
        harness.close_open_harnesses()


@pytest.fixture(scope="module", autouse=True)
def _no_ticking_threads_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = ticking_threads_outliving(before)
    if left:
        counts = ", ".join(f"{n} x {name}" for name, n in sorted(Counter(left).items()))
        pytest.fail(f"ticking threads outlived this module: {counts}; shut down "
                    "what started them (a connector harness closes itself, a planner, "
                    "health monitor or node tier needs its close/shutdown)", pytrace=False)


def make_config(**overrides):
    """A HiCacheConfig parsed the way the connector parses it."""
    from vllm_hicache.config import HiCacheConfig

    return HiCacheConfig.from_extra_config(overrides)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from tiny_model import build_tiny_llama

    return build_tiny_llama(REPO / ".cache" / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_gemma3_dir() -> Path:
    """A Gemma3-like model: sliding-window and full-attention layers (hybrid),
    untied embeddings so its greedy answers follow the context."""
    from tests.hybrid_models import build_tiny_gemma3

    return build_tiny_gemma3(REPO / ".cache" / "tiny-gemma3-untied", tie_word_embeddings=False)


@pytest.fixture
def node_root() -> Iterator[str]:
    """A fresh tmpfs directory for a node tier (its own directory goes
    inside), removed after the test."""
    with tmpfs_dir("hicache-node-test-") as root:
        yield str(root)
