"""mooncake_master + mooncake_client (storage daemon) for the mooncake tests.

Both listen on 127.0.0.1 free ports; the transfer engine inside every
Mooncake process also opens listeners on all interfaces, so run the session
inside a private network namespace (``unshare -n`` with lo up). Metadata is
P2PHANDSHAKE (no metadata server). The master keeps its index in memory: a
restart on the same port comes back empty, and the daemon re-attaches by
itself. Every wait is bounded.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.storage.ports import free_port

INSTALL_HINT = ("apt-get install -y libibverbs1 && "
                "pip install mooncake-transfer-engine-non-cuda")
_READY_TIMEOUT_S = 20.0




def binary(name: str) -> str:
    """A Mooncake console script, next to this Python or on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed ({INSTALL_HINT})")
    return found


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class MooncakeServices:
    """One master and one storage daemon holding ``segment`` of memory."""

    def __init__(self, workdir: Path, segment: str = "512MB", lease_ms: int = 1000) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.segment = segment
        self.lease_ms = lease_ms
        self.master_port, self.metrics_port, self.daemon_port = (
            free_port(), free_port(), free_port())
        self.master: subprocess.Popen | None = None
        self.daemon: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def start(self) -> MooncakeServices:
        self.start_master()
        self.daemon = self._spawn("daemon", [
            binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.daemon_port}",
            f"--global_segment_size={self.segment}", "--local_buffer_size=16MB",
            f"--master_server_address={self.address}", "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
        ])
        if not wait_port(self.daemon_port, _READY_TIMEOUT_S, self.daemon):
            self._fail("mooncake_client", "daemon")
        self.wait_writable()
        return self

    def start_master(self) -> None:
        assert self.master is None or self.master.poll() is not None, "already running"
        self.master = self._spawn("master", [
            binary("mooncake_master"), "--rpc_address=127.0.0.1",
            f"--rpc_port={self.master_port}", "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ms}",
        ])
        if not wait_port(self.master_port, _READY_TIMEOUT_S, self.master):
            self._fail("mooncake_master", "master")

    def wait_writable(self, timeout_s: float = _READY_TIMEOUT_S) -> bool:
        """Until a pure client can store an object (the daemon's segment is
        mounted in the master), bounded."""
        import numpy as np
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.address) == 0
        buf = np.zeros(64, np.uint8)
        store.register_buffer(buf.ctypes.data, buf.nbytes)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                key = f"probe-{time.monotonic_ns()}"
                if store.batch_put_from([key], [buf.ctypes.data], [buf.nbytes]) == [0]:
                    store.batch_remove([key], True)
                    return True
                time.sleep(0.1)
            return False
        finally:
            store.unregister_buffer(buf.ctypes.data)
            store.close()

    def kill_master(self) -> None:
        """SIGKILL (an outage, not a shutdown) and reap."""
        _kill(self.master)

    def stop(self) -> None:
        _kill(self.daemon)
        _kill(self.master)

    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{role}.log", "ab")  # noqa: SIM115 - owned by the process
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.workdir)
        finally:
            log.close()

    def _fail(self, name: str, role: str) -> None:
        tail = (self.workdir / f"{role}.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"{name} did not start:\n{tail}")


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
