"""``nixl``: the L3 tier through NIXL's storage plugins: files (POSIX) or S3 objects (OBJ).

NIXL moves bytes between registered memory and storage; it has no key index,
listing or eviction. This backend supplies the naming, the atomic publish and
the size checks (nixl_posix.py, nixl_obj.py hold each store's layout and
invariants) and drives one NIXL agent per backend instance (nixl_engine.py:
registration, deadlines, transfers that outlive their call).

Data path: NIXL never touches the caller's buffers. Every transfer goes
through a slot of a backend-owned staging pool registered with the agent
(nixl_staging.py): a put copies the buffers into the slot first, a get copies
the slot into the buffers only when its read completed within the call. A
transfer that outlives its call (NIXL cannot cancel it) therefore writes or
reads only its own slot, never a host page the caller has freed and reused.
Cost: one memcpy per object; ``register_memory`` is a no-op. One object = one
remote descriptor (POSIX) or one PutObject / two ranged GETs (OBJ).

Failures are misses: a missing, short or unreadable object, a NIXL error, or a
transfer still running after ``timeout_s`` is a False for that key only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vllm_hicache.storage.base import Buffers, StorageBackend, StorageContext
from vllm_hicache.storage.nixl_config import NixlConfig
from vllm_hicache.storage.nixl_engine import NixlEngine
from vllm_hicache.storage.nixl_staging import StagingPool

logger = logging.getLogger(__name__)

_REMOTE_MEM = {"POSIX": "FILE", "OBJ": "OBJ"}
_COUNTERS = ("gets", "get_hits", "puts", "put_ok", "bytes_read", "bytes_written", "errors")


class NixlBackend(StorageBackend):
    """L3 objects in files or S3 through NIXL.

    Options (``hicache_storage_backend_extra_config``; unknown keys and
    options of the other plugin are refused):

    - ``plugin`` (default ``"POSIX"``): ``"POSIX"`` (files) or ``"OBJ"`` (S3).
    - ``timeout_s`` (default 10.0): bound on one get/put call's transfers; a
      transfer still running then is a miss (it is reaped later, and touches
      only its staging slot meanwhile).
    - ``agent_name`` (default ``hicache-<pid>-<random>``): the NIXL agent's name.

    POSIX:

    - ``path`` (required): directory of the objects, created if missing; must
      be writable at start (else ValueError). One file per key, 256 fan-out
      subdirectories, atomic publish (temp file + ``os.replace``).
    - ``posix_backend_params`` (default ``{"use_aio": "true"}``): NIXL POSIX
      plugin parameters: ``use_aio`` (libaio), ``use_uring``, ``use_posix_aio``
      (not recommended: one failed I/O wedges the agent), ``ios_pool_size``,
      ``kernel_queue_size``.

    OBJ (needs boto3 for the start-up bucket check and ``clear``):

    - ``bucket`` (required): an existing bucket.
    - ``endpoint_override`` (default None = AWS): e.g. ``"http://127.0.0.1:9000"``.
    - ``region`` (default ``"us-east-1"``).
    - ``access_key`` / ``secret_key`` (default None = AWS default credential
      chain); never logged or shown.
    - ``scheme`` (default: the endpoint's, else ``"https"``).
    - ``key_prefix`` (default ``"hicache/"``): prepended to object names;
      ``clear`` deletes only names under it.
    - ``obj_backend_params`` (default path-style addressing and
      ``req_checksum=supported``): extra NIXL OBJ plugin parameters.

    ``stats()``: gets, get_hits, puts, put_ok, bytes_read, bytes_written,
    errors (calls that raised inside), timeouts (requests that missed their
    deadline), parked_transfers (of those, still running), staging_bytes
    (the staging pool's size).
    """

    name = "nixl"

    def __init__(self, options: Mapping[str, Any], ctx: StorageContext) -> None:
        self.config = NixlConfig.from_options(options)
        self.ctx = ctx
        plugin = self.config.plugin
        self._engine = _start_engine(self.config)
        self._staging = StagingPool(self._engine, ctx.object_bytes)
        self._engine.retire = self._staging.retire
        try:
            self._store = self._open_store()
        except BaseException:
            self._engine.close()
            raise
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        logger.info("nixl L3 backend: plugin=%s at %s, agent %s, timeout %.1f s, role %s",
                    plugin, self._store.address, self._engine.name, self.config.timeout_s,
                    ctx.role)

    def _open_store(self) -> Any:
        if self.config.plugin == "POSIX":
            from vllm_hicache.storage.nixl_posix import PosixStore

            return PosixStore(self._engine, self._staging, str(self.config.path))
        from vllm_hicache.storage.nixl_obj import ObjStore

        return ObjStore(self._engine, self._staging, self.config)

    # --- StorageBackend ----------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if self._closed or not keys:
            return 0
        try:
            return self._store.exists_prefix(keys)
        except Exception:  # noqa: BLE001 - failure is a miss, never an exception
            self._count(errors=1)
            logger.warning("nixl: exists_prefix failed", exc_info=True)
            return 0

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        assert len(keys) == len(targets), (len(keys), len(targets))
        ok = self._call("get", keys, targets)
        nbytes = sum(b.nbytes for t, hit in zip(targets, ok) if hit for b in t)
        self._count(gets=len(keys), get_hits=sum(ok), bytes_read=nbytes)
        return ok

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        assert len(keys) == len(sources), (len(keys), len(sources))
        ok = self._call("put", keys, sources)
        nbytes = sum(b.nbytes for s, stored in zip(sources, ok) if stored for b in s)
        self._count(puts=len(keys), put_ok=sum(ok), bytes_written=nbytes)
        return ok

    def _call(self, op: str, keys: Sequence[str], buffers: Sequence[Buffers]) -> list[bool]:
        if self._closed or not keys:
            return [False] * len(keys)
        try:
            return getattr(self._store, op)(keys, buffers, self.config.timeout_s)
        except Exception:  # noqa: BLE001 - failure is a miss, never an exception
            self._count(errors=1)
            logger.warning("nixl: %s of %d objects failed", op, len(keys), exc_info=True)
            return [False] * len(keys)

    def register_memory(self, region: np.ndarray) -> None:
        """Nothing: transfers use the staging pool, never the caller's memory."""

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
        out["timeouts"] = self._engine.num_timeouts
        out["parked_transfers"] = self._engine.num_parked
        out["staging_bytes"] = self._staging.nbytes
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.close()
        self._staging.close(leak=self._engine.num_parked > 0)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta


def _start_engine(cfg: NixlConfig) -> NixlEngine:
    """The agent with its plugin; NIXL's own errors become ones naming the backend."""
    name = cfg.resolved_agent_name
    params = cfg.plugin_params()
    try:
        return NixlEngine(name, cfg.plugin, params, _REMOTE_MEM[cfg.plugin])
    except (ImportError, ValueError):
        raise
    except Exception as err:  # noqa: BLE001 - NIXL raises its own error types
        # Parameter names only: the OBJ ones include the secret key.
        raise RuntimeError(f"nixl backend: cannot start NIXL plugin {cfg.plugin} "
                           f"(parameters {sorted(params)}): {type(err).__name__}: {err}") from err
