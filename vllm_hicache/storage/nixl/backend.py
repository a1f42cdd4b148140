"""``nixl``: the L3 tier through NIXL's storage plugins: files (POSIX) or S3 objects (OBJ).

NIXL moves bytes between registered memory and storage; it has no key index,
listing or eviction. This backend supplies the naming, the atomic publish and
the size checks (posix.py, obj.py hold each store's layout and
invariants) and drives one NIXL agent per backend instance (engine.py:
registration, deadlines, transfers that outlive their call).

Data path: NIXL never touches the caller's buffers. Every transfer goes
through a slot of a backend-owned staging pool registered with the agent
(staging.py): a put copies the buffers into the slot first, a get copies
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
from vllm_hicache.storage.buffers import total_bytes
from vllm_hicache.storage.counters import Counters
from vllm_hicache.storage.log_throttle import LogThrottle
from vllm_hicache.storage.nixl.config import NixlConfig
from vllm_hicache.storage.nixl.engine import NixlEngine
from vllm_hicache.storage.nixl.staging import StagingSlots

logger = logging.getLogger(__name__)

_REMOTE_MEM = {"POSIX": "FILE", "OBJ": "OBJ"}
_COUNTERS = ("gets", "get_hits", "puts", "put_ok", "bytes_read", "bytes_written", "errors")


class NixlBackend(StorageBackend):
    """L3 objects in files or S3 through NIXL (see the module docstring);
    options: NixlConfig (config.py).

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
        self._staging = StagingSlots(self._engine, ctx.object_bytes)
        self._engine.retire = self._staging.retire
        try:
            self._store = self._open_store()
        except BaseException:
            self._engine.close()
            raise
        self._lock = threading.Lock()
        self._counts = Counters(*_COUNTERS)
        self._error_log = LogThrottle()
        self._closed = False
        logger.info("nixl L3 backend: plugin=%s at %s, agent %s, timeout %.1f s, role %s",
                    plugin, self._store.address, self._engine.name, self.config.timeout_s,
                    ctx.role)

    def _open_store(self) -> Any:
        if self.config.plugin == "POSIX":
            from vllm_hicache.storage.nixl.posix import PosixStore

            return PosixStore(self._engine, self._staging, self.config)
        from vllm_hicache.storage.nixl.obj import ObjStore

        return ObjStore(self._engine, self._staging, self.config)

    # --- StorageBackend ----------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if self._closed or not keys:
            return 0
        try:
            return self._store.exists_prefix(keys)
        except Exception:  # noqa: BLE001 - failure is a miss, never an exception
            self._note_error("exists_prefix", len(keys))
            return 0

    def get(self, keys: Sequence[str], targets: Sequence[Buffers]) -> list[bool]:
        assert len(keys) == len(targets), (len(keys), len(targets))
        ok = self._call("get", keys, targets)
        nbytes = sum(total_bytes(t) for t, hit in zip(targets, ok) if hit)
        self._counts.add(gets=len(keys), get_hits=sum(ok), bytes_read=nbytes)
        return ok

    def put(self, keys: Sequence[str], sources: Sequence[Buffers]) -> list[bool]:
        assert len(keys) == len(sources), (len(keys), len(sources))
        ok = self._call("put", keys, sources)
        nbytes = sum(total_bytes(s) for s, stored in zip(sources, ok) if stored)
        self._counts.add(puts=len(keys), put_ok=sum(ok), bytes_written=nbytes)
        return ok

    def _call(self, op: str, keys: Sequence[str], buffers: Sequence[Buffers]) -> list[bool]:
        if self._closed or not keys:
            return [False] * len(keys)
        try:
            return getattr(self._store, op)(keys, buffers, self.config.timeout_s)
        except Exception:  # noqa: BLE001 - failure is a miss, never an exception
            self._note_error(op, len(keys))
            return [False] * len(keys)

    def register_memory(self, region: np.ndarray) -> None:
        """Nothing: transfers use the staging pool, never the caller's memory."""

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict[str, float]:
        out = self._counts.snapshot()
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
        self._store.close()

    def _note_error(self, op: str, num_keys: int) -> None:
        """A call that raised inside: counted; logged with its traceback at
        most once a minute."""
        errors = self._counts.bump("errors")
        if self._error_log.ready():
            logger.warning("nixl: %s of %d objects failed (%d failures so far); misses",
                           op, num_keys, errors, exc_info=True)


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
