"""The node-tier benchmark (``benchmarks/bench_node_tier.py``): the sizes and
workloads (plan.py), the engine process and its client (instance.py,
fleet.py), host memory read from /proc (pss.py)."""
