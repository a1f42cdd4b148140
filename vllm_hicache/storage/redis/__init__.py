"""The ``redis`` L3 backend: one Redis (or Valkey) string per object.

- backend.py  RedisBackend: the on-store format, batches, failures
- config.py   its options (RedisConfig): the server URL, password, TLS
- wire.py     connections and the zero-copy RESP pipelines
- cluster.py  Redis Cluster routing (``cluster: true``): slots, redirections, failover
- cluster_options.py, slots.py  its options and its slot map
"""
