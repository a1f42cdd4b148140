"""Reuse distances (planner/reuse.py) against brute force, and the knee."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from tests.planner.logs import BS, LogBuilder, blocks
from vllm_hicache.planner.reuse import ReuseProfile, knee, reuse_profile


def random_log(seed: int, num_requests: int = 120) -> LogBuilder:
    """Conversations growing turn by turn over a few shared system prompts."""
    rng = random.Random(seed)
    b = LogBuilder()
    convs = {c: [f"sys{c % 3}", f"c{c}"] for c in range(12)}
    for i in range(num_requests):
        c = rng.randrange(12)
        convs[c] += [f"u{i}"] * rng.randint(0, 2) + [f"v{i}"]
        ext = blocks(*convs[c], f"o{i}")[len(convs[c]):]
        b.request(blocks(*convs[c]), rng.randint(len(convs[c]) * BS - 3, len(convs[c]) * BS + 9),
                  ext=ext if rng.random() < 0.5 else ())
        if ext and rng.random() < 0.5:
            convs[c].append(f"o{i}")
    return b


def accesses(b: LogBuilder):
    """(hash, counted) in order: ADMIT chains (loadable blocks count), FINISH extensions."""
    out = []
    for rec in b.records:
        if type(rec).__name__ == "Admit":
            limit = (rec.prompt_tokens - 1) // BS
            out += [(h, i < limit) for i, h in enumerate(rec.chain)]
        elif type(rec).__name__ == "Finish":
            out += [(h, False) for h in rec.chain_ext]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distances_match_a_brute_force_stack(seed):
    b = random_log(seed)
    expected: dict[int, int] = {}
    stack: list[bytes] = []  # most recent last
    for h, counted in accesses(b):
        if h in stack:
            distance = len(stack) - 1 - stack.index(h)
            stack.remove(h)
            if counted:
                expected[distance] = expected.get(distance, 0) + BS
        stack.append(h)
    profile = reuse_profile(b.records, BS)
    assert profile.histogram == sorted(expected.items())
    assert profile.distinct_blocks == len(stack)


@pytest.mark.parametrize("capacity", [1, 3, 8, 20, 60])
def test_the_cdf_is_the_hit_rate_of_an_lru_cache_of_that_size(capacity):
    b = random_log(7)
    lru: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for h, counted in accesses(b):
        if h in lru:
            hits += BS * counted
            lru.move_to_end(h)
        else:
            lru[h] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
    profile = reuse_profile(b.records, BS)
    prompt_tokens = sum(r.prompt_tokens for r in b.records if type(r).__name__ == "Admit")
    assert profile.hit_rate(capacity) == pytest.approx(hits / prompt_tokens)


def test_knee_is_where_more_capacity_stops_paying():
    """Half the tokens come back within 10 blocks, 40% more within 100 and
    the last 0.5% only at 10000: +10% capacity stops buying 1% at about 100."""
    profile = ReuseProfile([(9, 500), (99, 400), (9999, 5)], 1000, 95, 10000)
    assert profile.max_hit_rate == pytest.approx(0.905)
    at = knee(profile)
    assert 100 <= at <= 111
    assert profile.hit_rate(at) == pytest.approx(0.9)


def test_no_reuse_no_knee():
    b = LogBuilder()
    b.request(blocks("x", "y"))
    b.request(blocks("z"))
    profile = reuse_profile(b.records, BS)
    assert profile.histogram == [] and knee(profile) is None
    assert profile.cold_tokens == 3 * BS
