"""A real ``vllm serve``: the README's quick-start command, as written.

``vllm-hicache serve`` (the installed console script: vLLM's own CLI, see
vllm_hicache/cli.py) with vLLM's default multiprocess executor, the tiny local
model and the README's ``--kv-transfer-config`` (HiCache with the ``file``
L3 backend, no ``kv_connector_module_path``: the plugin entry point registers
the connector) on 127.0.0.1, against the same server without HiCache. Greedy
OpenAI ``/v1/completions`` requests with shared prefixes, token-id prompts:

    round 1   three prompts sharing a 5-block prefix
    flood     unrelated prompts that evict round 1 from L1 (32 blocks)
    round 2   round 1 again, plus two new prompts with the same prefix

A third server, a second HiCache instance on the same L3 directory (empty L1
and L2), then gets round 2's first prompt. The three start together, once
per module (about 75 s on 2 busy cores), compute with one thread each
(``VLLM_CPU_OMP_THREADS_BIND``) so that every server computes alike, and are
stopped by terminating their process groups (bounded waits).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_ports

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("vllm-hicache")
# A server's start (imports, model load, warm-up) took up to 3 min on 2 busy
# cores; a failed start still ends at once (wait_healthy watches the process).
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
# An 8-token answer takes about a second; on a CI machine whose disk stalled
# (a 13 s health probe of the file L3) one took over 60 s. A server that
# really hangs still fails the test, after this long.
REQUEST_TIMEOUT_S = 300.0
MAX_TOKENS = 8
BLOCK = 32
# L1 = 1 MiB of KV: 32 blocks of 32 tokens (as tests/e2e/engine_utils.py).
TEST_ARGS = [
    "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
    "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(1 << 20),
    "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
    "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
]

PREFIX = [3 + (i * 37) % 470 for i in range(5 * BLOCK)]


def _tail(k: int, n: int) -> list[int]:
    return [5 + (i * k * 13) % 470 for i in range(n)]


ROUND1 = [PREFIX + _tail(1, 45), PREFIX + _tail(2, 70), PREFIX + _tail(3, 20)]
# 4 x 10 blocks > L1's 32: every round-1 block is evicted from L1.
FLOOD = [[7 + (i * 11 * k + 101 * k) % 470 for i in range(10 * BLOCK)] for k in range(1, 5)]
ROUND2 = ROUND1 + [PREFIX + _tail(4, 33), PREFIX + _tail(5, 90)]


def readme_serve_command() -> list[str]:
    """The command of the README's quick start, split as a shell would."""
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1]
    match = re.search(r"```bash\n(vllm-hicache serve .*?)\n```", section, re.S)
    assert match, "README's quick start has no `vllm-hicache serve` block"
    return shlex.split(match.group(1))


def readme_kv_transfer_config() -> dict:
    argv = readme_serve_command()
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def _with_l3_dir(argv: list[str], l3_dir: Path, **storage) -> list[str]:
    """``argv`` with the README's L3 directory replaced, ``storage`` keys added."""
    argv = list(argv)
    i = argv.index("--kv-transfer-config") + 1
    config = copy.deepcopy(json.loads(argv[i]))
    extra = config["kv_connector_extra_config"]
    extra["hicache_storage_backend_extra_config"]["path"] = str(l3_dir)
    extra["hicache_storage_backend_extra_config"].update(storage.pop("options", {}))
    extra.update(storage)
    argv[i] = json.dumps(config)
    return argv


def _no_proxy_opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


# What Python prints when a thread dies of an exception (threading.excepthook):
# a server whose listener thread died (a port it could not bind) may never
# answer, or answer without the part that died.
THREAD_DIED = "Exception in thread "


def wait_healthy(url: str, proc: subprocess.Popen, name: str, timeout_s: float,
                 log_tail, interval_s: float = 0.5, log_text=None) -> None:
    """Poll ``url``/health until it answers 200; fail the test (with
    ``log_tail()``) if ``proc`` exits first, if ``log_text()`` (when given)
    shows one of its threads died, or if ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    opener = _no_proxy_opener()
    for _ in range(int(timeout_s / interval_s) + 1):
        if time.monotonic() > deadline:
            break
        if proc.poll() is not None:
            pytest.fail(f"{name} exited ({proc.returncode}):\n{log_tail()}")
        if log_text is not None and THREAD_DIED in log_text():
            pytest.fail(f"{name}: a thread died while starting:\n{log_tail()}")
        try:
            with opener.open(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(interval_s)
    pytest.fail(f"{name} not ready after {timeout_s:.0f} s:\n{log_tail()}")


@dataclass
class Server:
    name: str
    argv: list[str]
    log_path: Path
    core: int | str  # a CPU, or another VLLM_CPU_OMP_THREADS_BIND ("nobind": several engines)
    port: int
    proc: subprocess.Popen | None = None
    request_timeout_s: float = REQUEST_TIMEOUT_S

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items()
               # Set by the in-process engine tests; the server uses vLLM's default.
               if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(self.core), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_CACHE_ROOT=str(self.log_path.parent / f"vllm-cache-{self.name}"),
                   # The test backends (``dynamic``: tests.storage.user_backend) must be
                   # importable in the server's processes too, started from .venv/bin.
                   PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]))
        argv = self.argv + ["--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO, start_new_session=True)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        wait_healthy(self.url, self.proc, f"{self.name} server", timeout_s, self.log_tail,
                     log_text=self.log)

    def stop(self) -> None:
        """SIGTERM the process group (API server, engine core, workers), then SIGKILL."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group is the server's
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(pgid, signal.SIGKILL)  # stragglers, if any
        self.proc.wait(timeout=10)
        for _ in range(100):  # up to 10 s for the group to be gone
            if not _signal_group(pgid, 0):
                break
            time.sleep(0.1)
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def complete(self, prompt: list[int], **fields) -> dict:
        body = json.dumps({
            "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **fields,
        }).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with _no_proxy_opener().open(req, timeout=self.request_timeout_s) as resp:
                out = json.loads(resp.read())
        except (OSError, ValueError) as err:  # URLError and HTTPError are OSErrors
            pytest.fail(f"{self.name} server: completion failed: {err!r}\n{self.log_tail()}")
        choice = out["choices"][0]
        return {"text": choice["text"], "token_ids": choice["token_ids"],
                "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
                "kv_transfer_params": out.get("kv_transfer_params")}

    def metrics_text(self) -> str:
        with _no_proxy_opener().open(f"{self.url}/metrics", timeout=REQUEST_TIMEOUT_S) as resp:
            return resp.read().decode()

    def metric(self, name: str) -> float:
        return metric_value(self.metrics_text(), name)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and all(w in line for w in want))


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@dataclass
class Run:
    """One server's answers to the workload, and what it showed."""
    round1: list[dict]
    flood: list[dict]
    round2: list[dict]
    external_hits: float
    log: str
    metrics: str = ""


# How long the HiCache server's L3 backups may take to show in /metrics.
BACKUP_SHOWN_S = 60.0


def _metrics_with_backups(server: Server) -> str:
    """/metrics once it counts L3 backups. The workers' counts reach vLLM's
    metrics with a step's output, and a backup still queued on a loaded
    machine when the last request ended shows only after the next step (seen
    in CI: 0 bytes at the scrape, 1.7 MB at shutdown): a one-token request,
    which fills no block, is that step."""
    deadline = time.monotonic() + BACKUP_SHOWN_S
    while True:
        metrics = server.metrics_text()
        shown = metric_value(metrics, "vllm:hicache_transfer_bytes_total", op="backup") > 0
        if shown or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)
        server.complete(ROUND1[0][:1], max_tokens=1)


def _serve_workload(server: Server) -> Run:
    round1 = [server.complete(p) for p in ROUND1]
    flood = [server.complete(p) for p in FLOOD]
    round2 = [server.complete(p) for p in ROUND2]
    metrics = (_metrics_with_backups(server) if server.name == "hicache"
               else server.metrics_text())
    hits = metric_value(metrics, "vllm:external_prefix_cache_hits_total")
    return Run(round1, flood, round2, hits, server.log(), metrics)


def _cores() -> tuple[int, int]:
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[-1]


def _argv(model_dir: Path) -> list[str]:
    """The README's command, MODEL replaced, run with the installed script."""
    argv = readme_serve_command()
    assert argv[:3] == ["vllm-hicache", "serve", "MODEL"]
    return [str(CLI), "serve", str(model_dir)] + argv[3:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The three servers, started together; the workload through the
    reference and HiCache servers, then the peer's first request."""
    if not CLI.exists():
        pytest.fail(f"{CLI} is missing: run `pip install -e . --no-deps` (or `make setup`)")
    tmp = tmp_path_factory.mktemp("serve")
    l3_dir = tmp / "l3"
    readme = _argv(tiny_model_dir)
    i = readme.index("--kv-transfer-config")
    ref_core, hicache_core = _cores()
    ports = free_ports(3)
    servers = {
        "reference": Server("reference", readme[:i] + readme[i + 2:] + TEST_ARGS,
                            tmp / "reference.log", ref_core, ports[0]),
        "hicache": Server("hicache", _with_l3_dir(readme, l3_dir) + TEST_ARGS,
                          tmp / "hicache.log", hicache_core, ports[1]),
        # wait_complete: its first request waits for the L3 prefetch.
        "peer": Server("peer", _with_l3_dir(readme, l3_dir,
                                            hicache_storage_prefetch_policy="wait_complete",
                                            options={"prefetch_threshold": BLOCK}) + TEST_ARGS,
                       tmp / "peer.log", hicache_core, ports[2]),
    }
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        out = {name: _serve_workload(servers[name]) for name in ("reference", "hicache")}
        out["worker_threads"] = worker_thread_cpus(servers["hicache"].proc.pid)
        # A request HiCache cannot read its controls of: answered, not fatal.
        out["bad_params"] = servers["hicache"].complete(
            ROUND1[0], kv_transfer_params={"max_load_tokens": -1})
        out["after_bad_params"] = servers["hicache"].complete(ROUND1[1])
        peer = servers["peer"]
        out["peer"] = peer.complete(ROUND2[0])
        out["peer_metrics"] = peer.metrics_text()
        out["peer_hits"] = metric_value(out["peer_metrics"],
                                        "vllm:external_prefix_cache_hits_total")
        out["peer_log"] = peer.log()
    finally:
        for server in servers.values():
            server.stop()
    return dict(out, l3_dir=l3_dir, cores=(ref_core, hicache_core))


def worker_thread_cpus(pgid: int) -> dict[str, set[frozenset[int]]]:
    """The CPU affinities of the server's worker threads, by thread name
    (the OS's: ours name themselves ``hicache-...``)."""
    cpus: dict[str, set[frozenset[int]]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[2]) != pgid:
                continue
            if not Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                cpus.setdefault(name, set()).add(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:  # gone meanwhile
            continue
    return cpus


def test_readme_config_needs_no_module_path():
    """So the HiCache server below also proves the plugin registration, in
    every process of a multiprocess engine."""
    config = readme_kv_transfer_config()
    assert config["kv_connector"] == "HiCacheConnector"
    assert "kv_connector_module_path" not in config
    assert config["kv_connector_extra_config"]["hicache_storage_backend"] == "file"


def test_outputs_identical_to_a_server_without_hicache(runs):
    reference, hicache = runs["reference"], runs["hicache"]
    for part in ("round1", "flood", "round2"):
        ref = [(r["text"], r["token_ids"]) for r in getattr(reference, part)]
        got = [(r["text"], r["token_ids"]) for r in getattr(hicache, part)]
        assert got == ref, part
        assert all(len(ids) == MAX_TOKENS for _, ids in got)


def test_hicache_serves_the_evicted_prefix(runs):
    reference, hicache = runs["reference"], runs["hicache"]
    # Round 1 was evicted from L1: without HiCache it is recomputed.
    assert reference.round2[0]["cached"] == 0
    assert reference.external_hits == 0
    # With HiCache it comes back from L2: at least the shared prefix, for the
    # first re-sent prompt (the others then also find it in L1).
    assert hicache.round2[0]["cached"] >= len(PREFIX)
    assert all(r["cached"] >= len(PREFIX) for r in hicache.round2)
    assert sum(r["cached"] for r in hicache.round2) > sum(r["cached"] for r in reference.round2)
    assert hicache.external_hits >= len(PREFIX)


def test_start_line_and_l3_objects(runs):
    log = runs["hicache"].log
    starts = [line for line in log.splitlines() if "HiCache: L1 32 blocks" in line]
    assert len(starts) == 1, log[-4000:]
    assert "L2 64 pages" in starts[0] and "(hicache_ratio=2)" in starts[0]
    assert "L3 file prefetch=best_effort" in starts[0] and str(runs["l3_dir"]) in starts[0]
    assert "Traceback" not in log, log[-4000:]
    peer_start = [line for line in runs["peer_log"].splitlines() if "HiCache: L1 " in line]
    assert len(peer_start) == 1
    assert "L3 file prefetch=wait_complete wait<=30 s threshold=32 tokens" in peer_start[0]
    # Pages were backed up to the file backend (beyond the start canary).
    assert len(list(runs["l3_dir"].rglob("*.hckv"))) > len(PREFIX) // BLOCK


def test_io_threads_run_off_the_compute_core(runs):
    """vLLM binds the worker's compute threads to the server's core; our
    L3 threads move to the core vLLM leaves for the connector."""
    other, compute = runs["cores"]
    if other == compute:
        pytest.skip("one allowed core: nothing to move the I/O threads to")
    assert f"I/O threads run on CPU cores [{other}]" in runs["hicache"].log
    threads = runs["worker_threads"]
    ours = {name: cpus for name, cpus in threads.items() if name.startswith("hicache-")}
    # The L3 pools, reads and writes apart, named for the OS.
    assert {"hicache-l3r-0", "hicache-l3w-0"} <= set(ours), threads
    assert all(cpus == {frozenset({other})} for cpus in ours.values()), ours  # ours moved
    vllms = set().union(*(cpus for name, cpus in threads.items() if name not in ours))
    assert frozenset({compute}) in vllms, threads  # the compute threads stay


def test_l3_serves_another_instance(runs):
    """The peer (same L3 directory, empty L1 and L2) finds the prefix the
    HiCache server computed in L3, and answers the same."""
    first, expected = runs["peer"], runs["reference"].round2[0]
    assert (first["text"], first["token_ids"]) == (expected["text"], expected["token_ids"])
    assert first["cached"] >= len(PREFIX), runs["peer_log"][-4000:]
    assert runs["peer_hits"] >= len(PREFIX)


def test_metrics_show_hicache_moving(runs):
    """/metrics of a real server: HiCache's series (metrics.py), and vLLM's
    per-source hit counter fed by get_external_cache_hit_sources."""
    text, pages = runs["hicache"].metrics, 2 * 32  # L2 = hicache_ratio 2 x 32 L1 blocks
    value = functools.partial(metric_value, text)
    assert value("vllm:hicache_hit_tokens_total", tier="L2") >= len(PREFIX)
    for op in ("load", "store", "backup"):
        assert value("vllm:hicache_transfer_bytes_total", op=op) > 0, op
        assert value("vllm:hicache_transfer_seconds_total", op=op) > 0, op
    assert value("vllm:hicache_l2_pages_total") == pages
    assert 0 < value("vllm:hicache_l2_pages_used") <= pages
    assert value("vllm:prompt_tokens_cached_by_source_total", source="host") >= len(PREFIX)
    assert value("vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
    assert "# HELP vllm:hicache_transfer_bytes_total" in text
    # The peer's hit came from L3: prefetched, then loaded.
    peer = functools.partial(metric_value, runs["peer_metrics"])
    assert peer("vllm:hicache_hit_tokens_total", tier="L3") >= len(PREFIX)
    assert peer("vllm:hicache_transfer_bytes_total", op="prefetch") > 0
    assert peer("vllm:hicache_prefetches_total", event="started") >= 1
    assert peer("vllm:prompt_tokens_cached_by_source_total", source="disk") >= len(PREFIX)


def test_bad_kv_transfer_params_are_answered(runs):
    bad, expected = runs["bad_params"], runs["reference"].round1[0]
    assert (bad["text"], bad["token_ids"]) == (expected["text"], expected["token_ids"])
    assert "max_load_tokens=-1" in bad["kv_transfer_params"]["hicache_error"]
    after = runs["after_bad_params"]
    assert after["token_ids"] == runs["reference"].round1[1]["token_ids"]
