"""The benchmark's side of instance.py: start an engine process, send it
commands, wait (bounded) for its answers.

Every instance computes with one OpenMP thread and is given the repository
on PYTHONPATH, whatever the caller's environment; its stderr goes to a log
file the error message names, so a failed start says why.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from node_tier.instance import REPLY_PREFIX

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "instance.py"
START_TIMEOUT_S = 900.0
COMMAND_TIMEOUT_S = 300.0


class InstanceError(RuntimeError):
    pass


class Instance:
    def __init__(self, name: str, spec: dict, log_dir: Path) -> None:
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env, cwd=REPO)
        self._replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.proc.pid
        self.ready_s: float | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                self._replies.put(json.loads(line[len(REPLY_PREFIX):]))
        self._replies.put(None)  # the process ended

    def _wait(self, what: str, timeout_s: float) -> dict:
        try:
            got = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise InstanceError(f"{self.name}: no answer to {what} within {timeout_s:.0f} s "
                                f"(log: {self.log_path})") from None
        if got is None:
            raise InstanceError(f"{self.name} ended (rc {self.proc.wait()}) before answering "
                                f"{what}: {self._log_tail()}")
        if "error" in got:
            raise InstanceError(f"{self.name}: {what} failed: {got['error']}")
        return got

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return f"(no log at {self.log_path})"

    def wait_ready(self) -> float:
        got = self._wait("the start", START_TIMEOUT_S)
        self.ready_s = got["ready_s"]
        return got["ready_s"]

    def call(self, op: str, **args: object) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise InstanceError(f"{self.name} is gone: {self._log_tail()}") from None
        return self._wait(op, COMMAND_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
