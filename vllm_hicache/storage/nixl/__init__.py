"""The ``nixl`` L3 backend: files (POSIX plugin) or S3 objects (OBJ plugin) through NIXL.

- backend.py  NixlBackend: data path through staging, failures as misses
- config.py   its options (NixlConfig), per plugin
- engine.py   one NIXL agent: registrations, deadlines, parked transfers
- staging.py  the backend-owned DRAM every transfer goes through
- posix.py    the POSIX store: file layout, atomic publish
- obj.py      the OBJ store: S3 object names, ranged reads, boto3 for clear
"""
