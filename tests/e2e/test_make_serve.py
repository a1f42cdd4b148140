"""``make serve`` (examples/serve.py): starts, prints a curl that works as
pasted, the /metrics and admin API URLs and admin curls that work as pasted
(sending the generated key), and stops cleanly on Ctrl-C (removing the key
file)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_ports

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "serve.py"
READY_TIMEOUT_S = 300.0


def test_makefile_serve_runs_the_script():
    recipe = (REPO / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "examples/serve.py" in recipe and "$(MODEL)" in recipe


def _read_until_ready(proc, out_path: Path) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = out_path.read_text()
        if "Ctrl-C stops the server." in text:
            return text
        if proc.poll() is not None:
            pytest.fail(f"serve.py exited ({proc.returncode}):\n{text}")
        time.sleep(0.5)
    pytest.fail(f"serve.py not ready after {READY_TIMEOUT_S:.0f} s:\n{out_path.read_text()}")


def test_make_serve(tiny_model_dir, tmp_path):
    port, admin_port = free_ports(2)
    out_path = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(max(os.sched_getaffinity(0)))
    with open(out_path, "w") as out:
        # Its own session, like a terminal's job: SIGINT to the group is a Ctrl-C.
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--port", str(port),
             "--admin-port", str(admin_port), "--l3-dir", str(tmp_path / "l3"),
             "--log", str(tmp_path / "serve.log"), "--admin-key-dir", str(tmp_path / "keys")],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        text = _read_until_ready(proc, out_path)
        curls = [line.strip() for line in text.splitlines()
                 if line.strip().startswith("curl ") and "/v1/completions" in line]
        assert len(curls) == 1, text
        answers = []
        for _ in range(2):  # run as pasted, twice: the second is a prefix hit
            done = subprocess.run(curls[0], shell=True, capture_output=True, text=True,
                                  timeout=120, env={**env, "no_proxy": "*"}, check=False)
            assert done.returncode == 0, done.stderr
            answers.append(json.loads(done.stdout))
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
        assert answers[0]["usage"]["completion_tokens"] == 16
        assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics_url = re.search(r"Metrics:\s+(\S+)", text).group(1)
        admin_url = re.search(r"Admin API:\s+(\S+)", text).group(1)
        assert metrics_url == f"http://127.0.0.1:{port}/metrics"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(metrics_url, timeout=30) as resp:
            assert b"vllm:prefix_cache_queries" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as err:  # the key is required
            opener.open(admin_url, timeout=60)
        assert err.value.code == 401
        key_file = tmp_path / "keys" / f"admin-api-{admin_port}.key"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        admin_get = next(line.strip() for line in text.splitlines()
                         if line.strip().startswith("curl ") and admin_url in line
                         and "-X" not in line)
        done = subprocess.run(admin_get, shell=True, capture_output=True, text=True,
                              timeout=60, env={**env, "no_proxy": "*"}, check=False)
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout)
        assert state["backend"] == "file" and state["extra_config"]["path"] == str(tmp_path / "l3")
    finally:
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"serve.py did not stop on SIGINT:\n{out_path.read_text()}")
    stop_s = time.monotonic() - start
    text = out_path.read_text()
    assert rc == 0, text
    assert "Stopped (exit status 0)." in text, text
    # vLLM's engine processes go with it (re-parented zombies are reaped
    # within a moment).
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("processes of the server are still running 10 s after it exited")
    assert stop_s < 60
    assert not (tmp_path / "keys" / f"admin-api-{admin_port}.key").exists()
