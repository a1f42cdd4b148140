"""The L3 (shared storage) tier: the scheduler half's planner (lookups,
prefetches, backups), the workers' I/O, their set-up from the vLLM config
(key namespaces, page identity, the start canary), and a rank's side of a
runtime attach or detach."""
