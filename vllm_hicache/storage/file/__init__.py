"""The ``file`` L3 backend: one file per object in a local or shared directory.

- backend.py   FileBackend: the directory's layout and invariants, batches
- config.py    its options (FileBackendConfig)
- io.py        key -> path, whole-object reads, atomic writes, scans
- capacity.py  ``max_bytes``: the usage counter shared by processes, LRU eviction
"""
