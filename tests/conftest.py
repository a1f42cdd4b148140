"""Shared fixtures: config builders, the local tiny model, and a tmpfs
directory for a node tier."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))


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
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="hicache-node-test-", dir=base)
    yield root
    shutil.rmtree(root, ignore_errors=True)
