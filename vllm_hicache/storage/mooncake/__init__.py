"""The ``mooncake`` L3 backend: one Mooncake Store object per L3 object.

- backend.py    MooncakeBackend: the on-store format, results, outages
- config.py     its options (MooncakeConfig) and the deployment they assume
- memory.py     the staging area, the only memory registered with Mooncake
- listeners.py  the engine's listeners (every interface), named at start
- master.py     reaching the master: a bounded start, failing fast while it is down
"""
