"""The scheduler half (EngineCore): the L2 index and every L2 decision
(lookups, loads, stores, write-backs), per-request state, and the plan of
what the workers copy each step. It never touches KV bytes."""
