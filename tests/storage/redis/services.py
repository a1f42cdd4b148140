"""redis-server processes for the redis backend tests.

Each server is private to the test session: loopback (or a unix socket in a
temporary directory), a free port, no persistence (``--save '' --appendonly
no``), so a restart on the same port comes back empty. Every wait is bounded.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.storage.ports import free_port

INSTALL_HINT = "apt-get install -y redis-server"
_READY_TIMEOUT_S = 15.0




class RedisServer:
    """One redis-server: TCP on 127.0.0.1:port, and a unix socket in workdir."""

    def __init__(self, workdir: Path, *extra_args: str, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(f"redis-server is not installed ({INSTALL_HINT})")
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.socket_path = workdir / "redis.sock"
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> RedisServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        args = [
            self.binary, "--bind", "127.0.0.1", "--port", str(self.port),
            "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"), *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until the server answers a PING on its port (bounded)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    # +PONG, or -NOAUTH when a password is required: up either way.
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        log = (self.workdir / "redis.log")
        tail = log.read_text()[-2000:] if log.exists() else ""
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")

    def kill(self) -> None:
        """SIGKILL (an outage, not a shutdown) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def client(self, **kwargs):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)
