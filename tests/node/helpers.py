"""What the node tier's tests share: the bytes every page must hold, the
tier they join, and child processes that join it and die on cue."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from vllm_hicache.node import NodeTier, join
from vllm_hicache.node.segment import HEADER_BYTES, SLOT_HEADER_BYTES

REPO = Path(__file__).resolve().parents[2]
NAME = "t"
IDENTITY = "test-identity"
PAGE_BYTES = 4096


def page_of(key: bytes, page_bytes: int = PAGE_BYTES) -> bytes:
    """The only bytes ``key``'s page may hold: a torn or foreign page differs."""
    seed = hashlib.sha256(key).digest()
    return (seed * (-(-page_bytes // len(seed))))[:page_bytes]


def capacity_for(slots: int, page_bytes: int = PAGE_BYTES) -> int:
    """A capacity of exactly ``slots`` pages (segment.py's layout)."""
    header = -(-(HEADER_BYTES + SLOT_HEADER_BYTES * slots) // 4096) * 4096
    return header + slots * page_bytes


def make(root: str, slots: int = 8, **kw) -> NodeTier:
    """Join the test tier of ``slots`` pages under ``root`` (``kw``: join's options)."""
    return join(kw.pop("name", NAME), kw.pop("identity", IDENTITY), capacity_for(slots),
                PAGE_BYTES, root=root, **kw)


def insert(tier: NodeTier, keys: list[bytes]) -> list[bytes]:
    """Publish ``keys``' pages; returns the keys evicted for them."""
    got = tier.reserve(len(keys))
    assert len(got.slots) == len(keys)
    for res, key in zip(got.slots, keys):
        tier.write(res, page_of(key))
        assert tier.seal(res, key)
    return got.evicted_keys


def buf() -> np.ndarray:
    return np.zeros(PAGE_BYTES, np.uint8)


class Child:
    """``python -m MODULE ARGS`` (by default tests.node.child); it prints
    ``ready`` once it is where the test wants it, and is then killed or
    waited for."""

    def __init__(self, *args: object, module: str = "tests.node.child") -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            self.kill()
            raise AssertionError(f"child not ready within {timeout_s} s")
        line = self.proc.stdout.readline().strip()
        if not line.startswith("ready"):
            self.proc.wait(30)
            raise AssertionError(f"child said {line!r}; stderr: {self.stderr()}")
        return line.removeprefix("ready").strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()
