"""L2 index: HiRadixTree, the metadata of host-pool pages. Pure Python."""

from vllm_hicache.index.node import LockHandle, MatchResult, NodeRef, NodeView, PinnedPages
from vllm_hicache.index.radix import HiRadixTree

__all__ = ["HiRadixTree", "LockHandle", "MatchResult", "NodeRef", "NodeView", "PinnedPages"]
