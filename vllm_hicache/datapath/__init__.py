"""The worker half's data path (L1 <-> L2), importable without vLLM.

``KVDataPath`` runs a step's copies in vLLM's hook order with plain
descriptors (``common/jobs.py``: ``BlockCopy``, ``LoadJob``): layerwise
loads on a transfer stream with one event per layer, async loads, stores
after the forward, write-back copies before it, and the mapping of failed copies to load errors. The
worker half (``connector/worker.py``) maps vLLM's hooks onto its calls and
hands it the scheduler's jobs as they are.
Nothing in this package imports vLLM, so it runs (and is tested,
``tests/gpu/``) on a GPU machine that has only torch and triton.
"""

from vllm_hicache.datapath.async_loads import AsyncLoader
from vllm_hicache.datapath.grouped import GroupedTransfer
from vllm_hicache.datapath.pipeline import KVDataPath, allocate_pool

__all__ = ["AsyncLoader", "GroupedTransfer", "KVDataPath", "allocate_pool"]
