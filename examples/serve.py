"""``make serve``: an OpenAI-compatible server with HiCache, ready to try.

    python examples/serve.py [--model .cache/tiny-llama] [--port 8000] [--admin-port 8001]

Starts ``vllm-hicache serve`` (vLLM's ``vllm serve``; vllm_hicache/cli.py)
on 127.0.0.1 with L2 (twice vLLM's KV cache) and the ``file`` L3 backend in
``.cache/serve-l3``, and the admin API (runtime attach/detach of L3) on
127.0.0.1 with a key made at start into ``.cache/admin-api-<port>.key``
(mode 0600; removed once the server has stopped). vLLM's output goes to
``.cache/serve.log`` (``VERBOSE=1`` shows it here). Once the server answers,
it prints a ready-to-paste ``curl`` for a completion, the ``/metrics`` URL and
the admin API's, with ``curl`` commands that send its key. Ctrl-C (SIGINT)
or SIGTERM stops it: the signal is passed to vLLM, which shuts its processes
down; exit status 0 when it did.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_hicache.config_admin import admin_key_file

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
SERVED_NAME = "tiny"
PROMPT = ("HiCache keeps the KV cache of prompts like this one in host memory and in a "
          "shared file store, so that a prompt sent again, by this server or by another "
          "one reading the same store, is loaded instead of computed again. Long system "
          "prompts, documents asked about many times and the history of a conversation "
          "are what it is for: the longer the shared prefix, the more compute it saves, "
          "and the sooner the first token of an answer arrives")


def kv_transfer_config(l3_dir: Path, admin_port: int, key_dir: Path) -> dict:
    return {
        "kv_connector": "HiCacheConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "hicache_ratio": 2.0,
            "hicache_write_policy": "write_through",
            "hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": {"path": str(l3_dir)},
            "admin_api_host": HOST,
            "admin_api_port": admin_port,
            # admin_api_key "auto" (the default) writes the key here.
            "admin_api_key_dir": str(key_dir),
        },
    }


def server_argv(model: Path, port: int, admin_port: int, l3_dir: Path,
                key_dir: Path) -> list[str]:
    cli = Path(sys.executable).with_name("vllm-hicache")
    return [
        str(cli), "serve", str(model), "--served-model-name", SERVED_NAME,
        "--host", HOST, "--port", str(port), "--enable-prefix-caching",
        # vLLM's CPU default is 128 tokens a block: too coarse for a short demo prompt.
        "--block-size", "32",
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        "--kv-transfer-config", json.dumps(kv_transfer_config(l3_dir, admin_port, key_dir)),
    ]


def completion_curl(port: int) -> str:
    # Long enough for whole KV blocks: sent twice, the second answer reports
    # them in usage.prompt_tokens_details.cached_tokens.
    body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 16,
                       "temperature": 0})
    return (f"curl -s http://{HOST}:{port}/v1/completions "
            f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")


def admin_curls(admin_port: int, key_dir: Path) -> list[str]:
    """Ready-to-paste admin calls, each sending the key file's key."""
    url = f"http://{HOST}:{admin_port}/hicache/storage-backend"
    key_file = shlex.quote(str(admin_key_file(str(key_dir), admin_port)))
    key = f'-H "Authorization: Bearer $(cat {key_file})"'
    return [f"curl -s {key} {url}            # backend, policies, L2 pages, counters",
            f"curl -s -X DELETE {key} {url}  # detach L3 (stored objects stay)"]


def _ready(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{HOST}:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-llama")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--admin-port", type=int, default=8001)
    parser.add_argument("--l3-dir", type=Path, default=REPO / ".cache" / "serve-l3")
    parser.add_argument("--log", type=Path, default=REPO / ".cache" / "serve.log")
    parser.add_argument("--admin-key-dir", type=Path, default=REPO / ".cache",
                        help="where the admin API's key file is made (admin_api_key_dir)")
    args = parser.parse_args()

    args.l3_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                        ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1")):
        env.setdefault(name, value)
    verbose = os.environ.get("VERBOSE", "") not in ("", "0")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    log = None if verbose else open(args.log, "wb")  # noqa: SIM115 - lives as long as the server
    print(f"Starting vllm-hicache serve {args.model} on {HOST}:{args.port} "
          f"(L3: {args.l3_dir}; log: {'here' if verbose else args.log}) ...", flush=True)
    # Same process group: a Ctrl-C in the terminal reaches vLLM too.
    key_dir = args.admin_key_dir.resolve()
    argv = server_argv(args.model, args.port, args.admin_port, args.l3_dir, key_dir)
    server = subprocess.Popen(argv,
                              stdout=log, stderr=subprocess.STDOUT if log else None, env=env,
                              cwd=REPO)
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            print("\nStopping the server ...", flush=True)
        if server.poll() is None:
            server.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    deadline = time.monotonic() + START_TIMEOUT_S
    while not stopping and not _ready(args.port):
        if server.poll() is not None:
            print(f"The server exited ({server.returncode}) before it was ready:\n"
                  f"{_tail(args.log)}", file=sys.stderr, flush=True)
            return 1
        if time.monotonic() > deadline:
            print(f"The server was not ready after {START_TIMEOUT_S:.0f} s; stopping it.\n"
                  f"{_tail(args.log)}", file=sys.stderr, flush=True)
            stop(signal.SIGTERM, None)
            break
        time.sleep(0.5)
    if not stopping:
        admin = f"http://{HOST}:{args.admin_port}/hicache/storage-backend"
        print(
            "\nReady. A completion:\n\n"
            f"  {completion_curl(args.port)}\n\n"
            f"Metrics:   http://{HOST}:{args.port}/metrics\n"
            f"Admin API: {admin}\n"
            + "".join(f"  {curl}\n" for curl in admin_curls(args.admin_port, key_dir))
            + "\n"
            "Ctrl-C stops the server.", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:  # a second Ctrl-C while vLLM shuts down
        pass
    try:
        code = server.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print("The server did not stop in time; killing it.", file=sys.stderr, flush=True)
        server.kill()
        server.wait()
        return 1
    finally:
        # vLLM may kill its engine process before the connector removes it.
        admin_key_file(str(key_dir), args.admin_port).unlink(missing_ok=True)
    if stopping:
        print(f"Stopped (exit status {code}).", flush=True)
        return 0 if code in (0, -signal.SIGINT, -signal.SIGTERM) else 1
    print(f"The server exited ({code}).\n{_tail(args.log)}", file=sys.stderr, flush=True)
    return 1 if code else 0


if __name__ == "__main__":
    sys.exit(main())
