"""Start, query and stop one ``vllm-hicache serve`` for the end-to-end benchmark.

Every server listens on 127.0.0.1, computes with the same one core
(``VLLM_CPU_OMP_THREADS_BIND``: with a KV connector configured vLLM's CPU
backend reserves one more core, which on a small machine changes the model's
thread count; an explicit binding makes every system compute alike) and runs
with ``VLLM_SERVER_DEV_MODE=1`` so that the harness can empty vLLM's prefix
cache and the connector's L2 between phases (``POST
/reset_prefix_cache?reset_external=true``; L3 stays). A server's process group
is terminated at the end (SIGTERM, then SIGKILL after a bounded wait).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("vllm-hicache")
HOST = "127.0.0.1"
START_TIMEOUT_S = 420.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerSpec:
    """What differs between the systems: L1 size and the connector's config."""

    name: str
    l1_blocks: int
    # kv_connector_extra_config, or None for vLLM alone.
    hicache: dict | None = None


@dataclass
class Server:
    spec: ServerSpec
    model: Path
    served_name: str
    block_size: int
    block_bytes: int
    core: int
    workdir: Path
    max_model_len: int
    max_num_seqs: int
    max_batched_tokens: int
    # Appended to the log's name (a second server of the same spec).
    tag: str = ""
    # Where the file L3's directory goes (default: ``workdir``).
    l3_root: Path | None = None
    port: int = 0
    admin_port: int = 0
    proc: subprocess.Popen | None = None
    started_s: float = field(default=0.0)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.spec.name}{self.tag}.log"

    @property
    def l3_dir(self) -> Path:
        return (self.l3_root or self.workdir) / f"{self.spec.name}{self.tag}-l3"

    def argv(self) -> list[str]:
        argv = [
            str(CLI), "serve", str(self.model), "--served-model-name", self.served_name,
            "--host", HOST, "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
            "--kv-cache-memory-bytes", str(self.spec.l1_blocks * self.block_bytes),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_batched_tokens),
            "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]
        if self.spec.hicache is not None:
            extra = json.loads(json.dumps(self.spec.hicache))
            storage = extra.get("hicache_storage_backend_extra_config")
            if storage is not None:
                storage["path"] = str(self.l3_dir)
                extra["admin_api_host"] = HOST
                extra["admin_api_port"] = self.admin_port
                # A benchmark's own loopback server: no key file to manage.
                extra["admin_api_key"] = "none"
            argv += ["--kv-transfer-config", json.dumps({
                "kv_connector": "HiCacheConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
            })]
        return argv

    def start(self) -> None:
        self.port, self.admin_port = free_ports(2)
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(self.core), VLLM_SERVER_DEV_MODE="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1",
                   VLLM_CACHE_ROOT=str(self.workdir / f"vllm-cache-{self.spec.name}{self.tag}"))
        # The API server and the engine core (the scheduler half) run on the
        # other cores; the worker binds its compute threads to ``core`` itself.
        others = set(os.sched_getaffinity(0)) - {self.core} or {self.core}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=REPO, start_new_session=True,
                                         preexec_fn=lambda: os.sched_setaffinity(0, others))
        self.started_s = time.monotonic()

    def wait_ready(self) -> float:
        """Seconds from start to the first healthy answer."""
        deadline = self.started_s + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.spec.name} exited ({self.proc.returncode}):"
                                   f"\n{self.log_tail()}")
            try:
                if get(f"{self.url}/health", timeout=2).status == 200:
                    return time.monotonic() - self.started_s
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server {self.spec.name} not ready after {START_TIMEOUT_S:.0f} s:"
                           f"\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group is the server's
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        for _ in range(100):
            if not _signal_group(pgid, 0):
                break
            time.sleep(0.1)
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> str:
        return get(f"{self.url}/metrics", timeout=30).read().decode()

    def reset_caches(self, attempts: int = 50) -> None:
        """Empty vLLM's prefix cache (L1) and, with HiCache, L2 (L3 stays)."""
        for _ in range(attempts):
            body = post(f"{self.url}/reset_prefix_cache?reset_external=true")
            if json.loads(body or "{}").get("success"):
                return
            time.sleep(0.2)  # blocks still held: retry
        raise RuntimeError(f"{self.spec.name}: /reset_prefix_cache kept failing")

    def clear_l3(self) -> None:
        """Delete every L3 object (admin API)."""
        post(f"http://{HOST}:{self.admin_port}/hicache/storage-backend/clear")


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, timeout: float):
    return _opener().open(url, timeout=timeout)


def post(url: str, timeout: float = 60) -> str:
    req = urllib.request.Request(url, data=b"", method="POST",
                                 headers={"Content-Type": "application/json"})
    with _opener().open(req, timeout=timeout) as resp:
        return resp.read().decode()


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            socks.append(sock)
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
