"""The shared floor: pure types both halves and the data path use (page
operations and page states, KV events, counters, the wire jobs). Nothing
here imports vllm or torch."""
