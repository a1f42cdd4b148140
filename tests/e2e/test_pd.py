"""Prefill/decode disaggregation: HiCache next to NixlConnector, through vllm-router.

Topology, on loopback (started once per module, about 2 minutes on 2 cores):

    reference   ``vllm-hicache serve`` without any connector
    prefill     MultiConnector(NixlConnector kv_producer, HiCache kv_producer)
    decode      MultiConnector(NixlConnector kv_consumer, HiCache decode offload)
    router      ``vllm-router --vllm-pd-disaggregation`` in front of the two

The two ``--kv-transfer-config``s are the README's ("Prefill/decode
disaggregation"), with the L3 directory replaced and one ``model_version`` on
both sides; NixlConnector moves KV over UCX with ``kv_buffer_device="cpu"``.
Greedy float32, token-id prompts. A two-turn conversation through the router:

    turn 1   a 50-token prompt, 72 tokens generated: decode computes KV for
             121 tokens, so blocks 1 and 2 (tokens 32..95) exist only on
             decode (prefill computed 50 tokens: block 0)
    turn 2   turn 1's prompt and answer plus 20 new tokens: prefill must find
             blocks 1 and 2 in L3, written there by decode

Negative control: once those servers are up, the model's weights are rewritten
in place (a new file: the running servers keep theirs) and a second decode
instance (same path, same ``model_version``, so the same L3 keys) starts on
them behind a second router; a new conversation's second turn, prefilled by
the unchanged prefill instance from what that decode wrote, then differs from
the reference's answer to the same tokens.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_serve import (
    CLI,
    REPO,
    TEST_ARGS,
    Server,
    _free_ports,
    _signal_group,
    metric_value,
    wait_healthy,
)

pytestmark = pytest.mark.engine

ROUTER = CLI.with_name("vllm-router")
BLOCK = 32
MODEL_VERSION = "pd-test-weights"
TURN1_TOKENS = 50
TURN1_MAX_TOKENS = 72
TURN2_NEW_TOKENS = 20
# Blocks 1 and 2: full only once decode has computed tokens 50..95.
DECODE_ONLY_TOKENS = 2 * BLOCK
BACKUP_WAIT_S = 30.0
ROUTER_START_S = 60.0
# Five servers start on two shared cores (about 2 minutes when idle): under a
# loaded CI machine the fifth can need much longer than one server alone.
SERVER_START_S = 600.0


def _tokens(seed: int, n: int) -> list[int]:
    return [3 + (i * (7 + 2 * seed) + 31 * seed) % 470 for i in range(n)]


# --- the README's configurations ------------------------------------------------

def readme_pd_configs() -> dict[str, dict]:
    """The ``--kv-transfer-config`` of the README's prefill and decode commands."""
    section = (REPO / "README.md").read_text().split("## Prefill/decode disaggregation", 1)[1]
    section = section.split("\n## ", 1)[0]
    configs = {}
    for block in re.findall(r"```bash\n(VLLM_NIXL_SIDE_CHANNEL_PORT=.*?)\n```", section, re.S):
        argv = shlex.split(block)
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        configs[config["kv_role"]] = config
    assert set(configs) == {"kv_producer", "kv_consumer"}, configs
    return configs


def readme_router_argv() -> list[str]:
    section = (REPO / "README.md").read_text().split("## Prefill/decode disaggregation", 1)[1]
    match = re.search(r"```bash\n(vllm-router .*?)\n```", section, re.S)
    assert match, "README's PD section has no vllm-router command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def _hicache_entry(config: dict) -> dict:
    entries = config["kv_connector_extra_config"]["connectors"]
    assert [e["kv_connector"] for e in entries] == ["NixlConnector", "HiCacheConnector"]
    return entries[1]


def _for_test(config: dict, l3_dir: Path) -> str:
    config = copy.deepcopy(config)
    extra = _hicache_entry(config)["kv_connector_extra_config"]
    extra["hicache_storage_backend_extra_config"]["path"] = str(l3_dir)
    extra["model_version"] = MODEL_VERSION
    if not extra.get("hicache_decode_offload"):
        extra["hicache_storage_backend_extra_config"]["prefetch_threshold"] = BLOCK
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
        # Picked just before it binds them: the servers' own ephemeral binds
        # could take ports picked at the start of the module.
        port, prometheus_port = _free_ports(2)
        for flag, value in (("--prefill", prefill.url), ("--decode", decode.url),
                            ("--port", str(port))):
            argv[argv.index(flag) + 1] = value
        # Its Prometheus exporter listens too (by default on one fixed port).
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
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


def _page_bytes(model_dir: Path) -> int:
    """Bytes of one block of KV (float32, every layer, K and V)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
            * BLOCK * 4)


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


def _perturb_weights(model_dir: Path) -> None:
    """Rewrite the K and V projections (a new file, renamed over the old one:
    running servers keep the weights they loaded)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = t + 3 * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    tmp = model_dir / "model.safetensors.new"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _conversation(router: Router, decode: Server, seed: int, page_bytes: int) -> dict:
    """Two turns through ``router``; turn 2 waits for decode's L3 writes of turn 1."""
    turn1 = _tokens(seed, TURN1_TOKENS)
    backed_up = _backup_bytes(decode)
    answer1 = router.complete(turn1, TURN1_MAX_TOKENS)
    # Blocks 0..2 of turn 1 (block 0 may already be in L3, written by prefill).
    _wait_backups(decode, backed_up + DECODE_ONLY_TOKENS // BLOCK * page_bytes)
    turn2 = turn1 + answer1 + _tokens(seed + 100, TURN2_NEW_TOKENS)
    answer2 = router.complete(turn2, 8)
    return {"turn1": turn1, "answer1": answer1, "turn2": turn2, "answer2": answer2}


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    for tool in (CLI, ROUTER):
        if not tool.exists():
            pytest.fail(f"{tool} is missing: run `make setup` (the test extra installs "
                        "vllm-router)")
    tmp = tmp_path_factory.mktemp("pd")
    # A copy of its own: the negative control rewrites its weights in place.
    model_dir = tmp / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    l3_dir = tmp / "l3"
    configs = readme_pd_configs()
    cores = sorted(os.sched_getaffinity(0))
    ports = _free_ports(8)

    def serve(name: str, port: int, core: int, config: str | None, model: Path) -> Server:
        argv = [str(CLI), "serve", str(model)] + TEST_ARGS
        if config is not None:
            argv += ["--kv-transfer-config", config]
        return Server(name, argv, tmp / f"{name}.log", core, port)

    servers = {
        "reference": serve("reference", ports[0], cores[0], None, tiny_model_dir),
        "prefill": serve("prefill", ports[1], cores[0],
                         _for_test(configs["kv_producer"], l3_dir), model_dir),
        "decode": serve("decode", ports[2], cores[-1],
                        _for_test(configs["kv_consumer"], l3_dir), model_dir),
    }
    routers: list[Router] = []
    out = {"model_dir": model_dir, "l3_dir": l3_dir}
    page_bytes = _page_bytes(model_dir)
    try:
        _start(servers["reference"])
        _start(servers["prefill"], ports[3])
        _start(servers["decode"], ports[4])
        for server in servers.values():
            server.wait_ready(SERVER_START_S)
        # Negative control: a decode instance on other weights, same L3 keys;
        # it starts while the conversation runs (the others loaded theirs).
        _perturb_weights(model_dir)
        servers["bad_decode"] = serve("bad_decode", ports[6], cores[-1],
                                      _for_test(configs["kv_consumer"], l3_dir), model_dir)
        _start(servers["bad_decode"], ports[7])

        routers.append(Router(servers["prefill"], servers["decode"], tmp / "router.log"))
        routers[0].wait_ready()
        out["conv"] = _conversation(routers[0], servers["decode"], 1, page_bytes)
        out["prefill_metrics"] = servers["prefill"].metrics_text()
        out["decode_metrics"] = servers["decode"].metrics_text()

        servers["bad_decode"].wait_ready(SERVER_START_S)
        routers.append(Router(servers["prefill"], servers["bad_decode"], tmp / "router2.log"))
        routers[1].wait_ready()
        out["bad_conv"] = _conversation(routers[1], servers["bad_decode"], 2, page_bytes)
        out["prefill_metrics_after_bad"] = servers["prefill"].metrics_text()

        ref = servers["reference"]
        for conv in ("conv", "bad_conv"):
            c = out[conv]
            c["ref1"] = ref.complete(c["turn1"], max_tokens=TURN1_MAX_TOKENS)["token_ids"]
            c["ref2"] = ref.complete(c["turn2"], max_tokens=8)["token_ids"]
        out["logs"] = {name: s.log() for name, s in servers.items()}
    finally:
        for router in routers:
            router.stop()
        for server in servers.values():
            server.stop()
    return out


def _l3_hit_tokens(metrics: str) -> float:
    return metric_value(metrics, "vllm:hicache_hit_tokens_total", tier="L3")


def test_readme_configs_have_the_pd_roles():
    configs = readme_pd_configs()
    prefill, decode = (_hicache_entry(configs[r]) for r in ("kv_producer", "kv_consumer"))
    assert prefill["kv_role"] == "kv_producer" and decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"]["hicache_decode_offload"] is True
    assert "hicache_decode_offload" not in prefill["kv_connector_extra_config"]
    # Same L3 backend and layout options on both sides: the keys must agree.
    shared = {k: v for k, v in prefill["kv_connector_extra_config"].items()
              if k != "hicache_storage_prefetch_policy"}
    assert shared == {k: v for k, v in decode["kv_connector_extra_config"].items()
                      if k != "hicache_decode_offload"}


def test_two_turns_through_the_router_match_one_instance(pd):
    conv = pd["conv"]
    assert len(conv["answer1"]) == TURN1_MAX_TOKENS
    assert conv["answer1"] == conv["ref1"]
    assert conv["answer2"] == conv["ref2"]


def test_second_turn_prefill_loads_what_decode_wrote_to_l3(pd):
    """Blocks 1 and 2 of the conversation were computed only on decode: a
    prefill hit on them in L3 is decode's offload."""
    hits = _l3_hit_tokens(pd["prefill_metrics"])
    assert hits >= DECODE_ONLY_TOKENS, pd["logs"]["prefill"][-4000:]
    assert metric_value(pd["prefill_metrics"], "vllm:prompt_tokens_cached_by_source_total",
                        source="disk") >= DECODE_ONLY_TOKENS


def test_decode_only_offloads(pd):
    """Decode never looks up or loads through HiCache; it writes to L3."""
    metrics = pd["decode_metrics"]
    assert metric_value(metrics, "vllm:hicache_hit_tokens_total") == 0
    assert metric_value(metrics, "vllm:hicache_prefetches_total") == 0
    assert metric_value(metrics, "vllm:hicache_transfer_bytes_total", op="load") == 0
    assert metric_value(metrics, "vllm:hicache_transfer_bytes_total", op="backup") > 0
    starts = [line for line in pd["logs"]["decode"].splitlines() if "HiCache: L1 " in line]
    assert len(starts) == 1 and "PD decode offload" in starts[0]
    for name in ("prefill", "decode", "bad_decode"):
        assert "Traceback" not in pd["logs"][name], pd["logs"][name][-4000:]


def test_negative_control_decode_written_kv_is_used(pd):
    """A decode instance with other weights (same L3 keys) writes different
    KV: the second turn's prefill loads it, and its answer changes."""
    bad = pd["bad_conv"]
    assert bad["answer1"] != bad["ref1"], "the rewritten weights changed nothing"
    hits = (_l3_hit_tokens(pd["prefill_metrics_after_bad"])
            - _l3_hit_tokens(pd["prefill_metrics"]))
    assert hits >= DECODE_ONLY_TOKENS
    assert bad["answer2"] != bad["ref2"]
