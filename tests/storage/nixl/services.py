"""A local S3 server (moto) for the nixl backend's OBJ tests.

moto_server listens on 127.0.0.1 and a free port, holds everything in
memory, and is private to the test session. Every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.storage.ports import free_port

INSTALL_HINT = "pip install 'moto[server]' boto3"
ACCESS_KEY = "testing"
SECRET_KEY = "testing-secret"
_READY_TIMEOUT_S = 30.0




def _moto_binary() -> str | None:
    here = Path(sys.executable).with_name("moto_server")
    return str(here) if here.exists() else shutil.which("moto_server")


class MotoServer:
    def __init__(self, workdir: Path) -> None:
        binary = _moto_binary()
        if binary is None:
            raise RuntimeError(f"moto_server is not installed ({INSTALL_HINT})")
        self.binary = binary
        self.port = free_port()
        self.log = workdir / "moto.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server on port {self.port} did not start:\n"
                           f"{self.log.read_text()[-2000:]}")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
