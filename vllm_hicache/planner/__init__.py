"""Capacity planner: replay an access log (``hicache_access_log``) through the
same HiRadixTree and policies for a sweep of L2 and L3 sizes.

``python -m vllm_hicache.planner LOG`` prints hit rate and prefill tokens
saved against capacity, the reuse-distance CDF, the knee and a cost line,
and plots them when matplotlib is installed (``pip install
'vllm-hicache[bench]'``). Pure package: no torch, no vllm (matplotlib only
inside ``plots``, imported on demand).

- ``log_format``: the log's frames and records (the writer is
  ``scheduler/access_log.py``);
- ``l1``: vLLM's prefix cache (L1), run once per log;
- ``replay``: L2 (HiRadixTree) and L3 driven as the scheduler half drives
  them, once per size (``model``: its config, its result, the L3 LRU);
- ``reuse``: reuse distances, their CDF, the knee;
- ``report``: the sweep, the cost model, the text;
- ``plots``: PNGs.
"""
