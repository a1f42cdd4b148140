"""Randomized, model-based stress test of node-tier hits while the admin API
detaches and attaches L3, on vLLM's real Scheduler (tests/connector/
harness.py: both of our halves, a fake forward that writes each token's
exact KV).

Two instances, A and B, share one node tier and serve test_stress.py's
traffic (shared prefixes, old conversations coming back, aborts, L1
resets, late async loads), so B's requests find what A computed in the
tier and load it into L1 directly (node_hits.py), or defer their L3 lookup
to the node tier's arrival probe (arrivals.py). At seeded random moments
B's L3 is detached (the node tier and all, pending backups finished or
dropped), replaced, or attached again (the node tier in front of a new
in-memory store), between a request's arrival and its first schedule pass
included. After every step both scheduler halves pass
``check_integrity()``, every block loaded from L2 or straight from the
tier holds exactly the bytes computed for it, and no hook raises; at the
end, traffic stopped and every acknowledgement delivered, no pin is left.

``HICACHE_STRESS_STEPS`` (default 150 per seed here) and
``HICACHE_STRESS_NODE_SEEDS`` (default 3) make it a soak.
"""

from __future__ import annotations

import os
import random
import uuid

import pytest

from tests.admin.test_storage_control import mem_spec, settle
from tests.connector.harness import BLOCK, close_open_harnesses, make_harness
from tests.connector.test_stress import WRITE_POLICIES, drain, traffic_step
from vllm_hicache.admin.api import parse_detach

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS = int(os.getenv("HICACHE_STRESS_STEPS", "150"))
SEEDS = int(os.getenv("HICACHE_STRESS_NODE_SEEDS", "3"))
# Per step, the chance that the admin API switches B's L3 (detach or attach).
SWITCH_RATE = 0.05


@pytest.fixture
def shm_root(node_root):
    yield node_root
    close_open_harnesses()  # leave the tier before node_root removes it


def build(model_dir, root: str, load_mode: str, write_policy: str):
    return make_harness(
        model_dir, num_blocks=24, max_num_seqs=4, hicache_ratio=2,
        hicache_load_mode=load_mode, hicache_write_policy=write_policy,
        hicache_mem_layout="page_first_direct",
        node_tier_bytes=16 << 20, node_tier_name="stress-admin", node_tier_root=root,
        hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config={"prefetch_threshold": BLOCK})


def watch_node_loads(h, checks: list[bool]) -> None:
    """Check every block a direct node-tier load of ``h`` fills against the
    bytes computed for the request whose block table holds it."""
    queue = h.worker.worker._node.queue
    loader = queue.loader if queue is not None else None
    if loader is None or getattr(loader, "watched", False):
        return
    inner = loader.finish

    def finish(op, defer=None):
        n = inner(op, defer)
        manager = h.scheduler.kv_cache_manager
        for block_id in op.block_ids[:n]:
            owners = [(req_id, table.index(block_id)) for req_id in h.scheduler.requests
                      if block_id in (table := manager.get_block_ids(req_id)[0])]
            assert owners, f"block {block_id} was loaded for no request"
            req_id, index = owners[0]
            checks.append(h.check_block(block_id, h.hashes_of[req_id], index))
        return n

    loader.finish = finish
    loader.watched = True


def switch_l3(h, rng: random.Random) -> str:
    """Detach B's L3 or replace it (the node tier over a new memory store),
    or attach it again after a detach."""
    control = h.sched_half.storage_control
    pending = rng.choice(("finish", "drop"))
    if h.sched_half.l3 is not None and rng.random() < 0.5:
        kind, spec = "detach", parse_detach({"pending_backups": pending})
    else:
        kind = "replace" if h.sched_half.l3 is not None else "attach"
        spec = mem_spec(uuid.uuid4().hex, prefetch_policy="best_effort",
                        **({"pending_backups": pending} if kind == "replace" else {}))
    status, body = settle(h, control.submit("detach" if kind == "detach" else "attach", spec))
    assert status == 200, (kind, body)
    return kind


@pytest.mark.parametrize("seed", range(SEEDS))
def test_node_hits_survive_l3_detached_and_attached_under_traffic(tiny_model_dir, shm_root,
                                                                  seed: int) -> None:
    rng = random.Random(seed)
    # Every write policy and load mode across the default seeds.
    mode = ("layerwise", "async")[seed % 2]
    policy = WRITE_POLICIES[seed % len(WRITE_POLICIES)]
    a, b = (build(tiny_model_dir, shm_root, mode, policy) for _ in range(2))
    node_checks: list[bool] = []
    prefixes = [[rng.randrange(50, 450) for _ in range(rng.randint(2, 4) * BLOCK)]
                for _ in range(4)]
    histories: dict[str, list[list[int]]] = {"a": [], "b": []}
    next_ids = {"a": [0], "b": [0]}
    switches = {"detach": 0, "attach": 0, "replace": 0}
    deferred_at_switch = 0
    for _ in range(STEPS):
        for name, h in (("a", a), ("b", b)):
            traffic_step(h, rng, prefixes, next_ids[name], histories[name])
        if rng.random() < SWITCH_RATE:
            deferred_at_switch += sum(s.l3_lookup_deferred for s in b.sched_half._reqs.values())
            switches[switch_l3(b, rng)] += 1
        for h in (a, b):
            watch_node_loads(h, node_checks)
            h.step(complete_async=rng.random() < 0.7)
            h.sched_half.check_integrity()
    assert switches["detach"] and switches["attach"], switches
    assert node_checks, "no block was loaded from the node tier: the test exercised nothing"
    assert all(node_checks), "a block loaded from the node tier held other bytes"
    assert all(a.load_checks) and all(b.load_checks), "an L2 load held other bytes"
    for h in (a, b):
        drain(h)
    print(f"seed {seed} ({mode}, {policy}): {switches}, {len(node_checks)} node-loaded blocks, "
          f"{deferred_at_switch} deferred lookups pending at a switch")
