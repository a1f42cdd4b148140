"""The node tier on real vLLM CPU engines: a prefix computed by one engine
process is a node-tier hit for another engine on the same tier, loaded from
the shared segment straight into vLLM's cache (no L2 staging), with the
answers of a recomputation; the loaded KV is what the answers are made of
(pages overwritten after sealing, seals intact, are loaded as they are,
since their publisher checked them, and change the answers), pages whose
seals do not hold are refused and recomputed; an engine on another tier
name gets nothing.
Visible: each engine publishes the NODE KV events of the changes it made
(engine A the blocks it sealed, engine B, which loads them straight into
vLLM's cache, none of the blocks it only read),
counts its node-hit tokens, and announces the pages its stores evicted;
the admin GET's page counts equal its Prometheus counters exactly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
    worker_half,
)
from vllm_hicache.node.segment import HEADER_BYTES as SEGMENT_HEADER_BYTES
from vllm_hicache.node.segment import SLOT_HEADER_BYTES
from vllm_hicache.storage.format import HEADER_BYTES

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]


def node_extra(root: str, name: str) -> dict:
    return {
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
        "node_tier_bytes": 16 << 20,
        "node_tier_name": name,
        "node_tier_root": root,
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"prefetch_threshold": 32},
    }


def expected_hits(prompts) -> list[int]:
    return [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


def node_hits() -> float:
    """Objects this process's worker read from the node tier through L2 (the
    engine runs in-process); the start-up canary reads one, so tests compare
    deltas."""
    return worker_half()._io.pages.backend.stats()["node_tier_hits"]


def direct_loader():
    """This process's worker's loader of node-tier pages straight into L1."""
    queue = worker_half()._node.queue
    assert queue is not None and queue.loader is not None
    return queue.loader


def overwrite_every_payload(tier) -> int:
    """Fill the payload of every sealed page with 0x46 bytes (float32
    12689.6), leaving header and seal intact; how many pages."""
    g = tier.geometry
    mapping = np.frombuffer(tier.mapping(), np.uint8)
    sealed = tier._index.sealed()
    for page in sealed:
        start = g.data_offset + page.slot * g.slot_stride + HEADER_BYTES
        mapping[start:start + g.page_bytes - HEADER_BYTES] = 0x46
    return len(sealed)


def tear_every_seal(tier) -> int:
    """Flip a generation bit of every sealed page's seal (a torn or foreign
    slot, still listed by the index); how many."""
    mapping = np.frombuffer(tier.mapping(), np.uint8)
    sealed = tier._index.sealed()
    for page in sealed:
        mapping[SEGMENT_HEADER_BYTES + page.slot * SLOT_HEADER_BYTES] ^= 0x01
    return len(sealed)


def start_engine_a(model_dir, extra, events_endpoint: str | None = None) -> subprocess.Popen:
    """Engine A in its own process: computes the prompts, waits until its
    pages are in the node tier, says so, and stays alive until stdin closes.
    With ``events_endpoint``, it publishes KV events there, says "ready"
    and waits for a line on stdin before it computes (PUB/SUB: the test
    subscribes first)."""
    kw = "{}" if events_endpoint is None else (
        "dict(kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher='zmq', "
        f"endpoint={events_endpoint!r}, topic='a'))")
    wait = "" if events_endpoint is None else 'print("ready", flush=True); sys.stdin.readline()'
    script = textwrap.dedent(f"""
        import sys
        from vllm.config import KVEventsConfig
        from tests.e2e.engine_utils import close, generate, make_llm, prompts_with_shared_prefix
        from tests.e2e.engine_utils import worker_half
        llm = make_llm({str(model_dir)!r}, {extra!r}, **{kw})
        {wait}
        generate(llm, prompts_with_shared_prefix())
        io = worker_half()._io
        for _ in range(2):  # a step carries the last backups to the worker
            generate(llm, [[7, 8]])
            assert io.wait_idle(60)
        print("inserted", int(io.pages.backend.stats()["node_tier_inserts"]), flush=True)
        sys.stdin.read()
        close(llm)
        print("done", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)


def wait_for_line(proc: subprocess.Popen, prefix: str) -> str:
    """The first line of ``proc``'s stdout that starts with ``prefix`` (vLLM
    logs to stdout too)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"engine A ended (rc {proc.wait()}) before {prefix!r}: "
                         f"{proc.stderr.read()[-4000:]}")


def test_a_prefix_computed_by_another_engine_is_a_node_tier_hit(tiny_model_dir, reference,
                                                                  node_root):
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    extra = node_extra(node_root, name)
    a = start_engine_a(tiny_model_dir, extra)
    try:
        line = wait_for_line(a, "inserted")
        assert int(line.split()[1]) > 0
        prompts = prompts_with_shared_prefix()
        # Engine B, alive at the same time as A: fresh L1 and L2, same tier.
        llm = make_llm(tiny_model_dir, extra)
        try:
            before = node_hits()
            pool_before = worker_half().pool.buffer.clone()
            outputs, cached = generate(llm, prompts)
            assert outputs == reference
            assert cached == expected_hits(prompts)
            # Every hit block came from the node tier straight into L1: no
            # prefetch staged it, no L2 read, the L2 pool untouched by them.
            loaded = direct_loader().counts["pages"]
            assert loaded * BLOCK_SIZE >= max(expected_hits(prompts))
            assert scheduler_half(llm).l3.prefetched_blocks == 0
            assert node_hits() == before
            assert scheduler_half(llm).stats.hit_tokens_l3 == loaded * BLOCK_SIZE
            assert scheduler_half(llm).stats.load_error_blocks == 0
            # Through the load gate as node-tier hits (loaded in the step:
            # the engine's default hicache_load_mode is layerwise).
            decisions = scheduler_half(llm).load_gate.decisions
            assert decisions.get(("node", "loaded")) == loaded * BLOCK_SIZE
            stored = int(scheduler_half(llm).stats.stored_blocks)
            changed = (worker_half().pool.buffer != pool_before).flatten(1).any(1).sum()
            assert int(changed) <= stored  # only what B itself computed
        finally:
            close(llm)
    finally:
        out, err = a.communicate(input="", timeout=120)
    assert a.returncode == 0 and "done" in out, err[-4000:]

    # Negative control: the loaded KV is what B's answers are made of. Every
    # payload overwritten after sealing, seals intact: loaded as it is (its
    # publisher checked it; readers check seals), and the answers change.
    llm = make_llm(tiny_model_dir, extra)
    try:
        loader = direct_loader()
        assert overwrite_every_payload(loader.tier) > 0
        outputs, _ = generate(llm, prompts)
        assert loader.counts["pages"] > 0 and loader.counts["refused"] == 0
        assert outputs != reference
        # Seals that no longer hold are refused: a recomputation's answers
        # (L1 and L2 emptied first, so that the node tier is asked again).
        assert llm.reset_prefix_cache(reset_connector=True)
        assert tear_every_seal(loader.tier) > 0
        pages = loader.counts["pages"]
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        assert loader.counts["refused"] > 0 and loader.counts["pages"] == pages
    finally:
        close(llm)

    # Negative control: the same prompts on another tier name find nothing.
    llm = make_llm(tiny_model_dir, node_extra(node_root, name + "-other"))
    try:
        before = node_hits()
        outputs, _ = generate(llm, prompts)
        assert outputs == reference
        assert scheduler_half(llm).l3.prefetched_blocks == 0
        assert node_hits() == before
    finally:
        close(llm)


def subscribe(endpoint: str, topic: bytes):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def drain(sub, quiet_s: float = 1.5) -> list:
    """Every event published until the publisher has been quiet a while."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events = []
    while sub.poll(int(quiet_s * 1000)):
        _topic, _seq, payload = sub.recv_multipart()
        events.extend(decoder.decode(payload).events)
    return events


def of(events, kind: str, medium: str) -> list:
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def hashes(events) -> set:
    return {h for e in events for h in e.block_hashes}


def get_view(sched) -> dict:
    """``tiers.node.instance`` of the admin API's GET (admin/status.py)."""
    return sched.l3.node_events.status(sched.stats.hit_tokens_node,
                                       sched.node_counts.total(sched.l3.backend))


PAGES = ("stored_pages", "promoted_pages", "evicted_pages")


def page_counts(llm, backends) -> tuple[dict, dict, dict]:
    """This instance's node tier page counts three ways: the GET's, the
    Prometheus counters', and the sum of its processes' own (``backends``:
    the worker's and the scheduler half's member), once a step has carried
    the last reports and counters in. The scheduler's member writes the
    health check's probe from a thread of its own, so up to five tries
    until no probe lands between the reads."""
    views: tuple[dict, dict, dict] = ({}, {}, {})
    for _ in range(5):
        generate(llm, [[7, 8]])  # a step: reports and counters in
        truth = {f: sum(int(b.counts()[c]) for b in backends)
                 for f, c in zip(PAGES, ("inserts", "promotions", "evictions"))}
        got = get_view(scheduler_half(llm))
        metrics = llm.get_metrics()
        prom = {f: sum(m.value for m in metrics if m.name == f"vllm:hicache_node_tier_{f}")
                for f in PAGES}
        views = ({f: got[f] for f in PAGES}, prom, truth)
        if views[0] == views[1] == views[2]:
            break
    return views


def settle(llm) -> None:
    """Backups written and their reports (tier changes) announced."""
    io = worker_half()._io
    for _ in range(2):
        generate(llm, [[7, 8]])
        assert io.wait_idle(60)


def test_node_events_come_once_per_machine_and_node_hits_are_counted(tiny_model_dir, reference,
                                                                     node_root, tmp_path):
    from vllm.config import KVEventsConfig

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    extra = node_extra(node_root, name)
    sub_a = subscribe(f"ipc://{tmp_path}/a-events", b"a")
    a = start_engine_a(tiny_model_dir, extra, f"ipc://{tmp_path}/a-events")
    try:
        wait_for_line(a, "ready")
        time.sleep(0.5)  # PUB/SUB: subscribed before anything is published
        a.stdin.write("go\n")
        a.stdin.flush()
        wait_for_line(a, "inserted")
        a_events = drain(sub_a)
        a_node = hashes(of(a_events, "BlockStored", "NODE"))
        # A announces the blocks it put into the tier, under the tier's name.
        assert a_node and a_node <= hashes(of(a_events, "BlockStored", "CPU"))
        assert {e.ownership for e in of(a_events, "BlockStored", "NODE")} == {name}

        prompts = prompts_with_shared_prefix()
        llm = make_llm(tiny_model_dir, extra, kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/b-events",
            topic="b"))
        sub_b = subscribe(f"ipc://{tmp_path}/b-events", b"b")
        try:
            time.sleep(0.5)
            outputs, cached = generate(llm, prompts)
            assert outputs == reference and cached == expected_hits(prompts)
            settle(llm)
            sched = scheduler_half(llm)
            # No remote store: every L3 hit token was found in the node tier.
            assert sched.stats.hit_tokens_l3 > 0
            assert sched.stats.hit_tokens_node == sched.stats.hit_tokens_l3
            status = get_view(sched)
            assert status["hit_tokens"] == sched.stats.hit_tokens_l3
            b_events = drain(sub_b)
            # B loaded A's blocks from the tier straight into vLLM's cache: it
            # stores none of them in its L2 (direct loads skip it) and
            # announces none of them for NODE (the tier's changes are
            # announced once, by the engine that made them).
            assert not a_node & hashes(of(b_events, "BlockStored", "CPU"))
            assert not a_node & hashes(of(b_events, "BlockStored", "NODE"))
            assert status["announced_stored_blocks"] == len(of(b_events, "BlockStored", "NODE"))
        finally:
            sub_b.close(linger=0)
            close(llm)
    finally:
        sub_a.close(linger=0)
        out, err = a.communicate(input="", timeout=120)
    assert a.returncode == 0 and "done" in out, err[-4000:]


def test_pages_a_store_evicts_from_the_tier_are_announced_removed(tiny_model_dir, node_root,
                                                                  tmp_path):
    from vllm.config import KVEventsConfig

    name = f"e2e-{uuid.uuid4().hex[:8]}"
    extra = {**node_extra(node_root, name), "node_tier_bytes": 384 << 10}  # a handful of pages
    llm = make_llm(tiny_model_dir, extra, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/events",
        topic="c"), disable_log_stats=False)  # the Prometheus counters too
    sub = subscribe(f"ipc://{tmp_path}/events", b"c")
    try:
        time.sleep(0.5)
        backend = worker_half()._io.pages.backend
        slots = backend.tier.stats().num_slots
        prompts = prompts_with_shared_prefix()
        generate(llm, prompts + [[p + 1 for p in q] for q in prompts])  # more blocks than slots
        settle(llm)
        events = drain(sub)
        stored = hashes(of(events, "BlockStored", "NODE"))
        removed = of(events, "BlockRemoved", "NODE")
        assert len(stored) > slots and removed
        assert hashes(removed) <= stored and {e.ownership for e in removed} == {name}
        status = get_view(scheduler_half(llm))
        assert status["announced_removed_blocks"] == len(hashes(removed))
        # The worker's stores and the scheduler's (the L3 health check's
        # probes), every change counted, also of a page evicted, stored
        # again and evicted again within one step: the GET's counts are
        # the Prometheus counters', exactly.
        get, prom, truth = page_counts(llm, (backend, scheduler_half(llm).l3.backend))
        assert get == prom == truth, (get, prom, truth)
        assert get["evicted_pages"] >= len(hashes(removed)) > 0
        assert get["stored_pages"] > slots
    finally:
        sub.close(linger=0)
        close(llm)
