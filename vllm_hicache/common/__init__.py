"""The shared floor: pure types both halves and the data path use (page
operations and page states, KV events, counters, the wire jobs, a daemon
thread pool). Nothing here imports vllm or torch."""
