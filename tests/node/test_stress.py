"""Randomized multi-process stress of the node tier alone: WORKERS members
(tests/node/stress_worker.py) insert, read (also in place, unpinned), look up, pin and unpin over a
tier smaller than their key space (eviction all the time), while this test
kills one or two of them with SIGKILL at random moments each round and
starts new ones. After every round, with the rest still running:

- no torn or foreign read: every worker verifies every page it reads
  against the key's bytes and would have exited (status 3);
- no page held by a dead process after the reclaim deadline: the killed
  members leave the index by the survivors' periodic sweeps alone, and no
  pin or reservation names a non-member;
- no lost capacity: free + reserved + sealed = the tier's slots (the index
  invariants of ``check_integrity``), and every seal matches its row;
- every sealed page reads back as its key's bytes.

Seeded (``HICACHE_NODE_STRESS_SEED``); the default run is 4 rounds (about
25 s on two busy cores); ``HICACHE_SOAK=1`` adds a soak of 40 rounds per seed
over 4 seeds (``make soak``).
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from tests.node.helpers import IDENTITY, NAME, PAGE_BYTES, Child, capacity_for, page_of
from tests.node.stress_worker import CHAINS, TORN, chain
from vllm_hicache.node import MemberStats, NodeTier, join

WORKERS = 4
SLOTS = 24  # the key space is 48 pages: eviction runs all the time
RECLAIM_DEADLINE_S = 3.0
SEED = int(os.getenv("HICACHE_NODE_STRESS_SEED", "0"))


def check_round(checker: NodeTier, killed: list[str]) -> None:
    for member in killed:
        start = time.monotonic()
        while member in checker.stats().members:
            assert time.monotonic() - start < RECLAIM_DEADLINE_S, (
                f"dead member {member} still holds its pages after {RECLAIM_DEADLINE_S} s")
            time.sleep(0.05)
    assert checker.check_integrity() == []
    s = checker.stats()
    assert s.free_slots + s.reserved_slots + s.sealed_slots == s.num_slots
    out = np.zeros(PAGE_BYTES, np.uint8)
    for c in range(CHAINS):
        for key in chain(c):
            if checker.read(key, out, verify_checksum=True):
                assert out.tobytes() == page_of(key), key


def run_stress(root: str, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    workers: dict[int, tuple[Child, str]] = {}
    done: dict[str, MemberStats] = {}  # each member's counters, last seen
    with join(NAME, IDENTITY, capacity_for(SLOTS), PAGE_BYTES, root=root,
              sweep_interval_s=0.2) as checker:
        try:
            for round_ in range(rounds):
                # Started together, then waited for: start-up is most of the time.
                started = {w: Child(root, SLOTS, seed * 1000 + round_ * 10 + w,
                                    module="tests.node.stress_worker")
                           for w in range(WORKERS) if w not in workers}
                for w, child in started.items():
                    workers[w] = (child, child.wait_ready())
                time.sleep(rng.uniform(0.2, 1.0))
                for member, counts in checker.stats().members.items():
                    done[member] = counts
                for w, (child, _) in workers.items():
                    if child.proc.poll() is not None:
                        pytest.fail(f"worker {w} exited with {child.proc.returncode} "
                                    f"({'torn read' if child.proc.returncode == TORN else ''}):"
                                    f" {child.stderr()}")
                killed = []
                for w in rng.sample(sorted(workers), rng.randint(1, 2)):
                    child, member = workers.pop(w)
                    child.kill()
                    killed.append(member)
                check_round(checker, killed)
        finally:
            members = [member for _, member in workers.values()]
            for child, _ in workers.values():
                child.kill()
        check_round(checker, members)
        s = checker.stats()
        assert (s.reserved_slots, s.pinned_slots) == (0, 0)
        assert list(s.members) == [checker.member_id]
    # The traffic was real: pages published, read back and evicted.
    for what in ("inserts", "hits", "evictions"):
        assert sum(getattr(m, what) for m in done.values()) > 0, what


def test_members_killed_at_random_never_tear_pages_or_leak_slots(node_root):
    run_stress(node_root, SEED, rounds=4)


@pytest.mark.soak
@pytest.mark.skipif(os.getenv("HICACHE_SOAK") != "1", reason="a soak: HICACHE_SOAK=1")
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_soak_members_killed_at_random(node_root, seed):
    run_stress(node_root, seed, rounds=40)
