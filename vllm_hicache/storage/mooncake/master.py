"""Reaching the Mooncake master: a bounded start, and failing fast while it is down.

At start, Mooncake's setup() retries an absent master for ~90 s (20 tries,
holding the GIL, so no Python timeout can cut it short): ``connect`` first
waits, bounded, for the master's port, and only then calls setup().

While the master is down, every Mooncake call blocks ~4.3 s before
returning RPC_FAIL (-900). Without a gate each I/O thread and the scheduler's
lookup thread would pay that on every call. ``OutageGate`` has two states:

- closed (master deemed up): every call goes to the store;
- open (a call saw RPC_FAIL): calls fail fast (misses) until
  ``backoff_s`` has passed, then one call at a time is let through as a
  probe. A probe that sees the master answer closes the gate; one that sees
  RPC_FAIL reopens it for another ``backoff_s``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from vllm_hicache.storage.mooncake.config import MooncakeConfig, split_address

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install Mooncake: on CPU-only machines `apt-get install -y libibverbs1 && "
    "pip install mooncake-transfer-engine-non-cuda`; with CUDA "
    "`pip install mooncake-transfer-engine` (never both)"
)
_PORT_RETRY_S = 0.2


class OutageGate:
    def __init__(self, backoff_s: float) -> None:
        self._backoff_s = backoff_s
        self._lock = threading.Lock()
        # None while closed; else when the next probe may go.
        self._open_until: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def admit(self) -> bool:
        """True: make the call, then ``record`` what it saw; False: fail fast."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or time.monotonic() < self._open_until:
                return False
            self._probing = True
            return True

    def record(self, rpc_failed: bool | None) -> None:
        """What an admitted call saw: RPC_FAIL (True), an answer (False), or
        nothing conclusive (None: an exception)."""
        with self._lock:
            # A regular call finishing during an outage may clear the flag of
            # a probe still in flight: at worst two probes, harmless.
            self._probing = False
            if rpc_failed:
                if self._open_until is None:
                    logger.warning("mooncake L3: master unreachable (RPC_FAIL); "
                                   "failing fast, probing every %.1f s", self._backoff_s)
                self._open_until = time.monotonic() + self._backoff_s
            elif rpc_failed is False and self._open_until is not None:
                logger.info("mooncake L3: master reachable again")
                self._open_until = None


def import_store() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise ImportError(f"mooncake backend: cannot import mooncake.store ({err}); "
                          f"{INSTALL_HINT}") from err
    return MooncakeDistributedStore


def connect(store_cls: type, cfg: MooncakeConfig) -> Any:
    """A set-up store client, or ConnectionError naming the master."""
    host, port = split_address(cfg.master_server_address)
    _wait_for_port(host, port, cfg.connect_timeout_s)
    store = store_cls()
    rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size,
                     cfg.local_buffer_size, cfg.protocol, cfg.device_name,
                     cfg.master_server_address)
    if rc != 0:
        store.close()
        raise ConnectionError(
            f"mooncake backend: setup against master {cfg.master_server_address} failed "
            f"(rc={rc}); check metadata_server={cfg.metadata_server!r} and protocol"
        )
    return store


def _wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, remaining))):
                return
        except OSError as err:
            if time.monotonic() + _PORT_RETRY_S >= deadline:
                raise ConnectionError(
                    f"mooncake backend: master {host}:{port} unreachable after {timeout_s:g} s "
                    f"({err}); is mooncake_master running there?"
                ) from None
        time.sleep(_PORT_RETRY_S)
