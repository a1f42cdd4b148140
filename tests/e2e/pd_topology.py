"""The prefill/decode-disaggregated topology of the PD engine tests
(test_pd.py: the tiny Llama; test_pd_hybrid.py: hybrid models), and the
checks they share.

Topology, on loopback (``run_pd_topology``, once per test module):

    reference   ``vllm-hicache serve`` without any connector
    prefill     MultiConnector(NixlConnector kv_producer, HiCache kv_producer)
    decode      MultiConnector(NixlConnector kv_consumer, HiCache decode offload)
    router      ``vllm-router --vllm-pd-disaggregation`` in front of the two

The two ``--kv-transfer-config``s are docs/pd.md's (its prefill and decode
commands, as documented), with the L3 directory replaced, one ``model_version`` on
both sides and a longer L3 breaker window; NixlConnector moves KV over UCX with
``kv_buffer_device="cpu"``.
Greedy, token-id prompts. A two-turn conversation through the router
(``Workload``; the default shape here):

    turn 1   a 50-token prompt, 72 tokens generated: decode computes KV for
             121 tokens, so blocks 1 and 2 (tokens 32..95) exist only on
             decode (prefill computed 50 tokens: block 0)
    turn 2   turn 1's prompt and answer plus 20 new tokens: prefill must find
             blocks 1 and 2 in L3, written there by decode

Negative control: a second decode instance on other weights (vLLM's dummy
loader: random ones) but the same path and ``model_version``, so the same L3
keys, behind a second router (same prefill), for a new conversation. Its
turn 2 through the router is decoded on the other weights, so that answer
differing would prove nothing about L3; instead turn 2 is then sent to the
prefill instance alone, which computes every token on the real weights over
the KV it loaded from L3 for that turn (kept in its prefix cache): that
answer differs from the reference's answer to the same tokens, where the
first conversation's (same path, the real decode) equals it.

All four servers start together (about 2 minutes on 2 idle cores).

Every server listens on 127.0.0.1 (and NIXL's side channel on a loopback
port of its own), so the topology runs in ``make test``'s private network
namespace.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.test_serve import (
    CLI,
    REPO,
    Server,
    _signal_group,
    metric_value,
    wait_healthy,
)
from tests.ports import free_ports

ROUTER = CLI.with_name("vllm-router")
BLOCK = 32
MODEL_VERSION = "pd-test-weights"
BACKUP_WAIT_S = 120.0  # returns once the count is steady: a slow disk only waits longer
ROUTER_START_S = 60.0
# Four servers start together on two shared cores (about a minute when idle):
# on a loaded CI machine they can need much longer than one server alone.
SERVER_START_S = 600.0


@dataclass(frozen=True)
class Workload:
    """The shape of a conversation, in tokens (the defaults: the one above)."""

    turn1_tokens: int = 50
    # A short answer (under 64 tokens): its decode-only blocks are far fewer
    # than a fixed 256-token prefetch threshold would fetch.
    turn1_max_tokens: int = 60
    turn2_new_tokens: int = 20
    turn2_max_tokens: int = 8

    @property
    def decode_only_blocks(self) -> range:
        """Blocks that are full only once decode has computed turn 1's answer
        (prefill computed the prompt; decode all but the last token)."""
        return range(self.turn1_tokens // BLOCK,
                     (self.turn1_tokens + self.turn1_max_tokens - 1) // BLOCK)

    @property
    def decode_only_tokens(self) -> int:
        return len(self.decode_only_blocks) * BLOCK


def _tokens(seed: int, n: int) -> list[int]:
    return [3 + (i * (7 + 2 * seed) + 31 * seed) % 470 for i in range(n)]


# --- the documented configurations (docs/pd.md) ----------------------------------

PD_DOC = REPO / "docs" / "pd.md"


def _pd_doc() -> str:
    """docs/pd.md: its only VLLM_NIXL_SIDE_CHANNEL_PORT and vllm-router
    blocks are the commands the tests run."""
    return PD_DOC.read_text()


def readme_pd_configs() -> dict[str, dict]:
    """The ``--kv-transfer-config`` of docs/pd.md's prefill and decode commands."""
    configs = {}
    for block in re.findall(r"```bash\n(VLLM_NIXL_SIDE_CHANNEL_PORT=.*?)\n```",
                            _pd_doc(), re.S):
        argv = shlex.split(block)
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        configs[config["kv_role"]] = config
    assert set(configs) == {"kv_producer", "kv_consumer"}, configs
    return configs


def readme_router_argv() -> list[str]:
    match = re.search(r"```bash\n(vllm-router .*?)\n```", _pd_doc(), re.S)
    assert match, f"{PD_DOC} has no vllm-router command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def hicache_entry(config: dict) -> dict:
    entries = config["kv_connector_extra_config"]["connectors"]
    assert [e["kv_connector"] for e in entries] == ["NixlConnector", "HiCacheConnector"]
    return entries[1]


def _for_test(config: dict, l3_dir: Path) -> str:
    config = copy.deepcopy(config)
    extra = hicache_entry(config)["kv_connector_extra_config"]
    extra["hicache_storage_backend_extra_config"]["path"] = str(l3_dir)
    extra["model_version"] = MODEL_VERSION
    # The checks below wait for decode's backups to reach L3. On a busy CI
    # machine one health check of the file store took 12 s (four servers
    # starting on two cores): the breaker tripped for an instant, a backup
    # made in it was skipped and the wait never ended. A window longer than
    # any such stall keeps the breaker on, as documented, without making the
    # test about it (tests/e2e/test_engine_l3_breaker.py covers the breaker).
    extra["l3_breaker_window_s"] = BACKUP_WAIT_S
    # No prefetch_threshold: the default ("auto", the cost model) must fetch
    # the few decode-only blocks of a short answer on its own.
    return json.dumps(config)


# --- processes ------------------------------------------------------------------

@contextlib.contextmanager
def _env(**values: str):
    """``values`` in this process's environment while a child is spawned."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start(server: Server, nixl_port: int | None = None) -> Server:
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_port)} if nixl_port else {}
    with _env(**env):
        server.start()
    return server


class Router:
    """vllm-router in PD mode in front of one prefill and one decode server."""

    def __init__(self, prefill: Server, decode: Server, log_path: Path) -> None:
        argv = readme_router_argv()
        assert argv[0] == "vllm-router"
        argv = [str(ROUTER)] + argv[1:]
        port, prometheus_port = free_ports(2)
        for flag, value in (("--prefill", prefill.url), ("--decode", decode.url),
                            ("--port", str(port))):
            argv[argv.index(flag) + 1] = value
        # Its Prometheus exporter listens too (by default on one fixed port).
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
        # A conversation's first request holds prefill's first forward and
        # decode's NIXL handshake with it: 31 s on an idle 2-core machine,
        # within test_serve's REQUEST_TIMEOUT_S on a loaded one.
        self.client = Server("router", [], log_path, 0, port)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=REPO, start_new_session=True)

    def wait_ready(self) -> None:
        wait_healthy(self.client.url, self.proc, "vllm-router", ROUTER_START_S,
                     lambda: self.log_path.read_text(errors="replace")[-4000:], interval_s=0.3)

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self.client.complete(prompt, max_tokens=max_tokens)["token_ids"]

    def stop(self) -> None:
        _signal_group(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, 9)
            self.proc.wait(timeout=10)


def page_bytes(model_dir: Path, dtype_bytes: int) -> int:
    """Bytes of one host page: one block of K and V of every layer (a Mamba
    layer's padded state page is as large as an attention layer's block)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
            * BLOCK * dtype_bytes)


def _backup_bytes(server: Server) -> float:
    return metric_value(server.metrics_text(), "vllm:hicache_transfer_bytes_total", op="backup")


def _wait_backups(decode: Server, min_bytes: int) -> float:
    """Wait until decode reports at least ``min_bytes`` backed up to L3 and the
    count is steady (its last acknowledgements have arrived)."""
    deadline, last, steady_since = time.monotonic() + BACKUP_WAIT_S, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        done = _backup_bytes(decode)
        if done != last:
            last, steady_since = done, time.monotonic()
        elif done >= min_bytes and time.monotonic() - steady_since > 1.0:
            return done
        time.sleep(0.2)
    pytest.fail(f"decode backed up {last} bytes to L3, expected >= {min_bytes}:\n"
                f"{decode.log_tail()}")


# --- the run --------------------------------------------------------------------

@dataclass
class Conversation:
    """Two turns through a router, and the reference's answers to the same tokens."""

    turn1: list[int]
    answer1: list[int]
    turn2: list[int]
    answer2: list[int]
    ref1: list[int] = field(default_factory=list)
    ref2: list[int] = field(default_factory=list)
    # Turn 2 sent afterwards to the prefill instance alone (no router, no
    # decode): its ``Server.complete`` answer, computed from its prefix cache.
    prefill_alone2: dict = field(default_factory=dict)
    # Prompt tokens the decode instance computed itself in turn 1 (vLLM's
    # ``prompt_tokens_by_source``): at most the last one (vLLM counts 0) when
    # it received the prompt's KV from prefill.
    decode_computed1: float = 0.0


@dataclass
class PDRun:
    """What the topology answered and showed, collected before it stopped."""

    conv: Conversation
    bad_conv: Conversation  # through the decode instance on other weights
    prefill_metrics: str  # after ``conv``
    decode_metrics: str  # after ``conv``
    prefill_metrics_after_bad: str
    logs: dict[str, str]  # server name -> its whole log
    workload: Workload


def _conversation(router: Router, decode: Server, seed: int, page_bytes: int,
                  workload: Workload) -> Conversation:
    """Two turns through ``router``; turn 2 waits for decode's L3 writes of turn 1."""
    turn1 = _tokens(seed, workload.turn1_tokens)
    backed_up = _backup_bytes(decode)
    computed = _locally_computed(decode)
    answer1 = router.complete(turn1, workload.turn1_max_tokens)
    computed1 = _locally_computed(decode) - computed
    # At least the decode-only blocks (the prompt's may already be in L3,
    # written by prefill).
    _wait_backups(decode, backed_up + len(workload.decode_only_blocks) * page_bytes)
    turn2 = turn1 + answer1 + _tokens(seed + 100, workload.turn2_new_tokens)
    answer2 = router.complete(turn2, workload.turn2_max_tokens)
    return Conversation(turn1, answer1, turn2, answer2, decode_computed1=computed1)


def _locally_computed(server: Server) -> float:
    """Prompt tokens ``server`` computed itself (not cached, not transferred)."""
    return metric_value(server.metrics_text(), "vllm:prompt_tokens_by_source_total",
                        source="local_compute")


def run_pd_topology(model_dir: Path, tmp: Path, serve_args: list[str], page_bytes: int,
                    workload: Workload = Workload()) -> PDRun:
    """Start the topology on ``model_dir`` (served with ``serve_args``), run
    both conversations, stop everything. ``page_bytes``: what decode's L3
    backup counter grows by per block."""
    for tool in (CLI, ROUTER):
        if not tool.exists():
            pytest.fail(f"{tool} is missing: run `make setup` (the test extra installs "
                        "vllm-router)")
    l3_dir = tmp / "l3"
    configs = readme_pd_configs()
    cores = sorted(os.sched_getaffinity(0))
    ports = free_ports(7)

    def serve(name: str, port: int, core: int, config: str | None, *extra: str) -> Server:
        argv = [str(CLI), "serve", str(model_dir)] + serve_args + list(extra)
        if config is not None:
            argv += ["--kv-transfer-config", _for_test(configs[config], l3_dir)]
        return Server(name, argv, tmp / f"{name}.log", core, port)

    servers = {
        "reference": serve("reference", ports[0], cores[0], None),
        "prefill": serve("prefill", ports[1], cores[0], "kv_producer"),
        "decode": serve("decode", ports[2], cores[-1], "kv_consumer"),
        # Negative control: same path and model_version (so the same L3
        # keys), other weights: vLLM's dummy loader draws random ones.
        "bad_decode": serve("bad_decode", ports[3], cores[-1], "kv_consumer",
                            "--load-format", "dummy"),
    }
    routers: list[Router] = []
    try:
        _start(servers["reference"])
        for name, nixl_port in zip(("prefill", "decode", "bad_decode"), ports[4:]):
            _start(servers[name], nixl_port)
        for server in servers.values():
            server.wait_ready(SERVER_START_S)
        for decode in ("decode", "bad_decode"):
            routers.append(Router(servers["prefill"], servers[decode],
                                  tmp / f"router-{decode}.log"))
        for router in routers:
            router.wait_ready()

        conv = _conversation(routers[0], servers["decode"], 1, page_bytes, workload)
        prefill_metrics = servers["prefill"].metrics_text()
        decode_metrics = servers["decode"].metrics_text()
        bad_conv = _conversation(routers[1], servers["bad_decode"], 2, page_bytes, workload)
        prefill_metrics_after_bad = servers["prefill"].metrics_text()

        ref = servers["reference"]
        for c in (conv, bad_conv):
            c.ref1 = ref.complete(c.turn1, max_tokens=workload.turn1_max_tokens)["token_ids"]
            c.ref2 = ref.complete(c.turn2, max_tokens=workload.turn2_max_tokens)["token_ids"]
            c.prefill_alone2 = servers["prefill"].complete(
                c.turn2, max_tokens=workload.turn2_max_tokens)
        logs = {name: s.log() for name, s in servers.items()}
    finally:
        for router in routers:
            router.stop()
        # All asked at once: each then takes its few seconds to exit together.
        for server in servers.values():
            if server.proc is not None:
                _signal_group(server.proc.pid, signal.SIGTERM)
        for server in servers.values():
            server.stop()
    return PDRun(conv, bad_conv, prefill_metrics, decode_metrics, prefill_metrics_after_bad,
                 logs, workload)


# --- checks ---------------------------------------------------------------------

# vLLM's per-process log prefix: "(Worker pid=1) ERROR 12-01 02:56:46 [file.py:12] ".
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                         r"\S+ \S+ \[[^\]]*\] ?")


def _tracebacks(log: str) -> list[str]:
    """Every Python traceback in ``log``, prefixes stripped, each up to and with
    its exception line (the first unindented line after the frames)."""
    found: list[str] = []
    current: list[str] | None = None
    for raw in log.splitlines():
        line = _LOG_PREFIX.sub("", raw)
        if line.startswith("Traceback (most recent call last)"):
            current = [line]
        elif current is not None:
            current.append(line)
            if line and not line[0].isspace():
                found.append("\n".join(current))
                current = None
    if current is not None:
        found.append("\n".join(current))
    return found


def _recovered_nixl_handshake(traceback: str) -> bool:
    """vLLM's NIXL side-channel handshake gives up after a fixed 5 s receive
    timeout (not configurable in 0.32); the request then recomputes its KV and
    the next request handshakes again. On a loaded 2-core CI machine the
    prefill's listener once answered too late: vLLM's behaviour, not ours,
    and the answers are still checked against the reference."""
    return ("in _nixl_handshake" in traceback
            and traceback.rstrip().splitlines()[-1].startswith("zmq.error.Again"))


def unexpected_tracebacks(log: str) -> list[str]:
    """The tracebacks in a server's log that are not vLLM's recovered NIXL
    handshake timeout."""
    return [tb for tb in _tracebacks(log) if not _recovered_nixl_handshake(tb)]


def l3_hit_tokens(metrics: str) -> float:
    return metric_value(metrics, "vllm:hicache_hit_tokens_total", tier="L3")


def check_two_turns_match_one_instance(run: PDRun) -> None:
    conv = run.conv
    assert len(conv.answer1) == run.workload.turn1_max_tokens
    assert conv.answer1 == conv.ref1
    assert conv.answer2 == conv.ref2
    # The negative control's measure, after a decode on the real weights: the same.
    assert conv.prefill_alone2["token_ids"] == conv.ref2


def check_second_turn_prefill_loads_decode_writes(run: PDRun) -> None:
    """Some blocks of the conversation were computed only on decode: a
    prefill hit on them in L3 is decode's offload."""
    want = run.workload.decode_only_tokens
    hits = l3_hit_tokens(run.prefill_metrics)
    assert hits >= want, run.logs["prefill"][-4000:]
    assert metric_value(run.prefill_metrics, "vllm:prompt_tokens_cached_by_source_total",
                        source="disk") >= want


def check_decode_only_offloads(run: PDRun) -> None:
    """Decode never looks up or loads through HiCache; it writes to L3."""
    metrics = run.decode_metrics
    assert metric_value(metrics, "vllm:hicache_hit_tokens_total") == 0
    assert metric_value(metrics, "vllm:hicache_prefetches_total") == 0
    assert metric_value(metrics, "vllm:hicache_transfer_bytes_total", op="load") == 0
    assert metric_value(metrics, "vllm:hicache_transfer_bytes_total", op="backup") > 0
    starts = [line for line in run.logs["decode"].splitlines() if "HiCache: L1 " in line]
    assert len(starts) == 1 and "PD decode offload" in starts[0]
    for name in ("prefill", "decode", "bad_decode"):
        unexpected = unexpected_tracebacks(run.logs[name])
        assert not unexpected, f"{name}:\n" + "\n\n".join(unexpected)


def hicache_changes(before: str, after: str) -> dict[str, float]:
    """The ``vllm:hicache_*`` samples (name and labels) that differ between
    two scrapes of one server: what its HiCache did in between."""
    def samples(text: str) -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("vllm:hicache_")}
    old, new = samples(before), samples(after)
    return {k: v - old.get(k, 0.0) for k, v in new.items() if v != old.get(k, 0.0)}


def check_decode_written_kv_is_used(run: PDRun) -> None:
    """Negative control: a decode instance with other weights (same L3 keys)
    writes different KV; the second turn's prefill loads it, and the prefill
    instance's own answer to that turn (real weights throughout, over
    the KV it loaded) changes."""
    bad = run.bad_conv
    assert bad.answer1 != bad.ref1, "the other weights changed nothing"
    hits = l3_hit_tokens(run.prefill_metrics_after_bad) - l3_hit_tokens(run.prefill_metrics)
    changes = hicache_changes(run.prefill_metrics, run.prefill_metrics_after_bad)
    assert hits >= run.workload.decode_only_tokens, (
        "prefill's HiCache over the second conversation:\n"
        + "\n".join(f"  {k} {v:+g}" for k, v in sorted(changes.items()))
        + "\n" + run.logs["prefill"][-4000:])
    # Its prefix cache served the prefix up to and with the loaded blocks.
    assert bad.prefill_alone2["cached"] >= run.workload.decode_only_blocks.stop * BLOCK
    assert bad.prefill_alone2["token_ids"] != bad.ref2
