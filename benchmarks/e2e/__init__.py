"""End-to-end serving benchmark (``benchmarks/bench_serve.py``): servers, clients, report."""
