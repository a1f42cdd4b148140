"""Builders for HiRadixTree tests: chained hashes, a fake clock, a checked tree."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from tests.fake_clock import FakeClock
from vllm_hicache.index import HiRadixTree
from vllm_hicache.policy import make_eviction_policy


class TreeKit:
    """A tree plus its fake clock and the hashes its on_evict reported."""

    @staticmethod
    def chain(tokens: Sequence[int]) -> list[bytes]:
        """Chained block hashes, like vLLM's: hash i names blocks 0..i."""
        hashes: list[bytes] = []
        prev = b"root"
        for token in tokens:
            prev = hashlib.blake2b(prev + token.to_bytes(4, "little"), digest_size=8).digest()
            hashes.append(prev)
        return hashes

    def __init__(self, num_pages: int = 16, policy: str = "lru") -> None:
        self.clock = FakeClock(0.0)
        self.evicted: list[bytes] = []
        self.tree = HiRadixTree(
            num_pages, make_eviction_policy(policy), self.clock, on_evict=self.evicted.extend
        )

    def put(self, hashes: list[bytes], mask: Sequence[bool] | None = None) -> list[int | None]:
        """Insert ``hashes`` with fresh pages where ``mask`` is true (default: all)."""
        mask = [True] * len(hashes) if mask is None else mask
        pages = self.tree.alloc(sum(mask))
        assert pages is not None
        it = iter(pages)
        given: list[int | None] = [next(it) if m else None for m in mask]
        assert self.tree.insert(hashes, given) == []
        self.tree.check_integrity()
        return given

    def num_nodes(self) -> int:
        stack, count = [self.tree.root_view()], -1
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


@pytest.fixture
def make_kit() -> type[TreeKit]:
    return TreeKit


@pytest.fixture
def kit() -> TreeKit:
    return TreeKit()
