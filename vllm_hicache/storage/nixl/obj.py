"""The ``nixl`` backend's OBJ store: one S3 object per key, moved by NIXL's OBJ plugin.

Object name: ``<key_prefix><key>`` in ``bucket``. The object's bytes are the
caller's buffers concatenated.

Invariants:

- Readers never see a partial object: a put is one S3 PutObject of the whole
  object, which S3 makes visible atomically (the OBJ plugin cannot write at an
  offset: a second descriptor would be a second PutObject replacing the
  first), from the job's staging slot (staging.py), which holds a copy
  of the caller's buffers. A put that misses its deadline is reported False
  but may still land later: whole, and with the bytes of the call, never of
  a page the caller reused afterwards.
- A get is two ranged GETs, each its own NIXL request: bytes ``[0, n-1)`` and the
  probe byte ``[n-1, n)``, where n is the buffers' total, into a staging
  slot copied to the caller's buffers only on success. An object shorter
  than n fails the probe (HTTP 416), so a truncated object is a miss. A
  *longer* object is not detected here (no size is exposed by NIXL); the
  object header's payload length catches it (storage/format.py).
- NIXL has no list or delete: ``clear`` and the start-up bucket check use
  boto3, and ``clear`` deletes only names under ``key_prefix``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm_hicache.storage.base import Buffers
from vllm_hicache.storage.batching import batched
from vllm_hicache.storage.buffers import address, gather, scatter, total_bytes
from vllm_hicache.storage.nixl.config import NixlConfig
from vllm_hicache.storage.nixl.engine import Job, NixlEngine
from vllm_hicache.storage.nixl.staging import StagingSlots

BOTO3_INSTALL = "pip install boto3"
# Bounds on boto3's calls: the start-up check fails well within 30 s.
_CONNECT_TIMEOUT_S = 3.0
_READ_TIMEOUT_S = 10.0
_DELETE_BATCH = 1000  # S3 DeleteObjects limit


class ObjStore:
    def __init__(self, engine: NixlEngine, staging: StagingSlots, cfg: NixlConfig) -> None:
        self.engine = engine
        self.staging = staging
        self.bucket = str(cfg.bucket)
        self.prefix = cfg.key_prefix
        self.endpoint = cfg.endpoint_url or "AWS S3"
        self._s3 = _s3_client(cfg)
        self._check_bucket()

    @property
    def address(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"

    def close(self) -> None:
        self._s3.close()

    def _check_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            raise ValueError(f"nixl backend (OBJ): bucket {self.bucket!r} at {self.endpoint} "
                             f"is not usable: {err}") from err
        except BotoCoreError as err:
            raise ConnectionError(f"nixl backend (OBJ): cannot reach {self.endpoint} "
                                  f"(bucket {self.bucket!r}): {err}") from err

    # --- operations ----------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            try:
                found = self.engine.agent.query_memory(
                    [(0, 0, 0, self.prefix + key)], "OBJ", "OBJ")
            except Exception:  # noqa: BLE001 - an unreachable store answers "not stored"
                return i
            if not found or found[0] is None:
                return i
        return len(keys)

    def get(self, keys: Sequence[str], targets: Sequence[Buffers], timeout_s: float) -> list[bool]:
        jobs = [self._read_jobs(k, t) for k, t in zip(keys, targets)]
        self.engine.transfer("READ", [j for parts in jobs for j in parts], timeout_s, batch=False)
        return [bool(parts) and all(j.done for j in parts) for parts in jobs]

    def put(self, keys: Sequence[str], sources: Sequence[Buffers], timeout_s: float) -> list[bool]:
        jobs = [self._write_job(k, s) for k, s in zip(keys, sources)]
        self.engine.transfer("WRITE", [j for j in jobs if j is not None], timeout_s, batch=False)
        return [job is not None and job.done for job in jobs]

    def clear(self) -> None:
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        names = [item["Key"] for page in pages for item in page.get("Contents", [])]
        for chunk in batched(names, _DELETE_BATCH):
            self._s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": name} for name in chunk], "Quiet": True})

    # --- jobs ------------------------------------------------------------------

    def _register(self, key: str) -> tuple[int, Any] | None:
        dev_id = self.engine.next_dev_id()
        try:
            return dev_id, self.engine.register_remote([(0, 0, dev_id, self.prefix + key)])
        except Exception:  # noqa: BLE001 - NIXL raises its own error types
            return None

    def _read_jobs(self, key: str, target: Buffers) -> list[Job]:
        """Two single-descriptor requests: the OBJ plugin reports ERR as soon as one
        GET of a request fails, with the request's other GETs possibly still running;
        alone in its request, a GET has ended when its request says DONE or ERR."""
        total = total_bytes(target)
        slot = self.staging.take(total) if total else None
        if slot is None:
            return []
        registered = self._register(key)
        if registered is None:
            self.staging.give(slot)
            return []
        dev_id, reg = registered
        cut = total - 1  # the probe byte: an object shorter than total fails its GET
        parts = [(0, cut), (cut, 1)] if cut else [(0, 1)]
        oks: list[bool] = []
        lock = threading.Lock()

        def finish(ok: bool) -> bool:
            with lock:
                oks.append(ok)
                if len(oks) < len(parts):
                    return ok
            try:  # the last part ended: no GET of this key runs any more
                self.engine.deregister(reg)
                if all(oks):  # both ended within the call (a reaped part is False)
                    scatter(slot, target)
            finally:
                self.staging.give(slot)
            return ok

        base = address(slot)
        return [Job([(base + off, n)], [(off, n, dev_id)], finish, keep=slot)
                for off, n in parts]

    def _write_job(self, key: str, source: Buffers) -> Job | None:
        total = total_bytes(source)
        slot = self.staging.take(total) if total else None
        if slot is None:
            return None
        registered = self._register(key)
        if registered is None:
            self.staging.give(slot)
            return None
        dev_id, reg = registered
        gather(source, slot)

        def finish(ok: bool) -> bool:
            try:
                self.engine.deregister(reg)
            finally:
                self.staging.give(slot)
            return ok

        return Job([(address(slot), total)], [(0, total, dev_id)], finish, keep=slot)


def _s3_client(cfg: NixlConfig) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as err:
        raise ImportError(f"the nixl L3 backend with plugin=OBJ needs boto3 (bucket checks "
                          f"and clear): {BOTO3_INSTALL} ({err})") from err
    virtual = cfg.plugin_params().get("use_virtual_addressing", "false") == "true"
    config = Config(connect_timeout=_CONNECT_TIMEOUT_S, read_timeout=_READ_TIMEOUT_S,
                    retries={"max_attempts": 2, "mode": "standard"},
                    s3={"addressing_style": "virtual" if virtual else "path"})
    return boto3.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                        aws_access_key_id=cfg.access_key,
                        aws_secret_access_key=cfg.secret_key, config=config)
