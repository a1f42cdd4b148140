"""The access log writer (scheduler/access_log.py): what it writes, that it
is bounded (queue, disk), counts what it drops, flushes on close, and never
fails a request; and its options in HiCacheConfig."""

from __future__ import annotations

import hashlib
import logging
import os
from types import SimpleNamespace

import msgpack
import pytest

from tests.conftest import make_config
from vllm_hicache.planner.log_format import (
    HASH_BYTES,
    Admit,
    Arrive,
    Drops,
    Finish,
    LogHeader,
    _record,
    encode_admit,
    read_log,
    read_logs,
)
from vllm_hicache.scheduler.access_log import AccessLogWriter

BS = 16
HEADER = LogHeader(block_size=BS, page_bytes=1024, ranks=2, l1_blocks=9, l2_pages=32,
                   l3_backend="file", l3_prefetch_policy="wait_complete",
                   l3_threshold_tokens=32, started=1000.0)
# Never woken by its timer: records reach the file only by flush() or close().
NO_TIMER_S = 3600.0


def chain(name: str, num_blocks: int) -> list[bytes]:
    out, prev = [], name.encode()
    for i in range(num_blocks):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


def request(req_id: str, hashes: list[bytes], num_tokens: int, **kw) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=num_tokens,
                           priority=kw.get("priority", 0),
                           num_computed_tokens=kw.get("num_computed_tokens", 0))


class FakePlanner:
    """L3Planner.prefetched_range and node_range, for the L2/L3/node split."""

    def __init__(self, ranges: dict[str, tuple[int, int]],
                 node: dict[str, tuple[int, int]] | None = None) -> None:
        self.ranges = ranges
        self.node = node or {}

    def prefetched_range(self, req_id: str):
        return self.ranges.get(req_id)

    def node_range(self, req_id: str):
        return self.node.get(req_id)


@pytest.fixture
def log_path(tmp_path):
    return tmp_path / "logs" / "access.log"


def test_records_roundtrip_with_header_and_tier_split(log_path):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    hashes = chain("a", 5)
    req = request("r1", hashes, 5 * BS + 3, priority=2)
    writer.arrive(req, step=7)
    # L1 had blocks 0-1; HiCache loaded blocks 2-4, of which 3-4 its prefetch brought.
    writer.admit(req, 2 * BS, 3 * BS, FakePlanner({"r1": (3, 6)}), step=8)
    req.block_hashes = hashes + chain("out", 2)  # two blocks completed while decoding
    req.num_computed_tokens = 7 * BS + 1
    writer.finish(req, 8, step=12)
    writer.close()
    assert os.stat(log_path).st_mode & 0o777 == 0o600
    log = read_log(log_path)
    assert log.header == HEADER and not log.truncated
    arrive, admit, finish = log.records
    assert arrive == Arrive(arrive.t_ms, 0, 7)
    assert admit == Admit(admit.t_ms, 0, 8, 5 * BS + 3, 2 * BS, 1 * BS, 2 * BS, 2,
                          tuple(h[:HASH_BYTES] for h in hashes))
    assert finish == Finish(finish.t_ms, 0, 12, 8,
                            tuple(h[:HASH_BYTES] for h in chain("out", 2)))
    assert 0 <= arrive.t_ms <= admit.t_ms <= finish.t_ms


def test_an_l3_hit_records_where_its_wait_went_and_old_records_still_read(log_path):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    hashes = chain("s", 4)
    stages = {"lookup": 0.0015, "io": 0.0042, "load_wait": 0.02}
    writer.admit(request("l3", hashes, 4 * BS + 1), 0, 4 * BS, FakePlanner({"l3": (0, 4)}),
                 l3_stages=stages)
    # Stages without L3 tokens are not written.
    writer.admit(request("l2", chain("t", 2), 2 * BS + 1), 0, 2 * BS, l3_stages=stages)
    writer.close()
    with_l3, without = read_log(log_path).records
    assert with_l3.l3_tokens == 4 * BS
    assert with_l3.l3_stages_us == {"lookup": 1500, "io": 4200, "load_wait": 20000}
    assert without.l3_stages_us is None
    # A record of an older writer (ten items, no stage map) reads as before.
    old = msgpack.unpackb(encode_admit(5, 1, 2, 3 * BS, 0, BS, 0, 0, b"x" * HASH_BYTES),
                          raw=False)
    assert len(old) == 10
    assert _record(old, HASH_BYTES) == Admit(5, 1, 2, 3 * BS, 0, BS, 0, 0, (b"x" * HASH_BYTES,))


def test_node_tier_tokens_are_recorded_beside_the_l3_ones(log_path):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    # L1 had block 0; HiCache loaded 1-4, its prefetch brought 2-4, the
    # lookup found 2-5 in the node tier (block 5 lies beyond this admission).
    writer.admit(request("n", chain("n", 5), 5 * BS + 1), BS, 4 * BS,
                 FakePlanner({"n": (2, 5)}, {"n": (2, 6)}))
    writer.admit(request("r", chain("r", 2), 2 * BS + 1), 0, 2 * BS, FakePlanner({"r": (0, 2)}))
    writer.close()
    node, remote = read_log(log_path).records
    assert (node.l2_tokens, node.l3_tokens, node.l3_node_tokens) == (BS, 3 * BS, 3 * BS)
    assert node.l3_stages_us is None  # written as nil before the node tokens
    assert (remote.l3_tokens, remote.l3_node_tokens) == (2 * BS, 0)
    # Without node tokens the record is as an older writer's (ten items).
    assert len(msgpack.unpackb(encode_admit(5, 1, 2, BS, 0, 0, BS, 0, b"x" * HASH_BYTES,
                                            None, 0), raw=False)) == 10


def test_queue_is_bounded_and_drops_are_counted_and_logged(log_path):
    writer = AccessLogWriter(log_path, HEADER, 10**6, max_queued=3, flush_s=NO_TIMER_S)
    for i in range(10):
        writer.admit(request(f"r{i}", chain(f"p{i}", 2), 2 * BS + 1), 0, 0)
    assert writer.num_dropped == 7
    writer.close()
    log = read_log(log_path)
    assert [r.seq for r in log.records if isinstance(r, Admit)] == [0, 1, 2]
    assert [r.num_dropped for r in log.records if isinstance(r, Drops)] == [7]
    assert read_logs([log_path]).num_dropped == 7


def test_close_writes_everything_queued(log_path):
    """Scenario: the writer thread never wakes (huge flush interval); the
    records still reach the file because close() drains the queue."""
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    for i in range(50):
        req = request(f"r{i}", chain(f"p{i}", 3), 3 * BS + 1)
        writer.admit(req, 0, 0)
        writer.finish(req, 4)
    assert len(read_log(log_path).records) == 0  # only the header so far
    writer.close()
    writer.close()  # idempotent
    assert len(read_log(log_path).records) == 100


def test_a_flush_after_close_is_refused_by_name(log_path):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    writer.close()
    writer.arrive(request("late", chain("late", 1), BS + 1))
    with pytest.raises(RuntimeError, match="written after close"):
        writer.flush()


def test_disk_use_is_capped_by_rotation(log_path):
    max_bytes = 20_000
    writer = AccessLogWriter(log_path, HEADER, max_bytes, flush_s=NO_TIMER_S)
    for i in range(400):
        writer.admit(request(f"r{i}", chain(f"p{i}", 20), 20 * BS + 1), 0, 0)
        if i % 10 == 9:
            writer.flush()  # one frame per 10 requests
    writer.close()
    old = log_path.with_name(log_path.name + ".1")
    assert old.exists()
    assert old.stat().st_size + log_path.stat().st_size <= max_bytes
    both = read_logs([old, log_path])
    seqs = [r.seq for r in both.records]
    assert seqs == sorted(seqs) and seqs[-1] == 399 and both.num_writers == 1


def test_an_existing_log_is_rotated_at_start(log_path):
    log_path.parent.mkdir(parents=True)
    log_path.write_bytes(b"the previous run")
    AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S).close()
    assert log_path.with_name("access.log.1").read_bytes() == b"the previous run"
    assert read_log(log_path).header == HEADER


def test_a_second_writer_of_the_same_path_writes_its_own_file(log_path):
    """Engines of a data-parallel server share their options, so their logs
    would clobber each other: the second takes ``<log>.<pid>``."""
    first = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    second = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    try:
        assert first.path == log_path
        assert second.path == log_path.with_name(f"access.log.{os.getpid()}")
    finally:
        first.close()
        second.close()
    assert read_log(log_path).header == read_log(second.path).header == HEADER
    third = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)  # lock released
    assert third.path == log_path
    third.close()


def test_sampling_keeps_or_drops_whole_prefix_families(log_path):
    header = LogHeader(**{**HEADER.to_map(), "sample": 0.5})
    writer = AccessLogWriter(log_path, header, 10**6, flush_s=NO_TIMER_S)
    families = {f"sys{k}": chain(f"sys{k}", 2) for k in range(40)}
    for name, prefix in families.items():
        for turn in range(3):  # requests sharing the family's first blocks
            req = request(f"{name}-{turn}", prefix + chain(f"{name}{turn}", 2), 4 * BS + 1)
            writer.admit(req, 0, 0)
    writer.close()
    logged = [r.chain for r in read_log(log_path).records]
    roots = {c[0] for c in logged}
    # Every family is all in or all out, and about half are in.
    assert len(logged) == 3 * len(roots)
    assert 10 <= len(roots) <= 30


def test_a_recording_error_turns_the_log_off_without_raising(log_path, caplog):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    with caplog.at_level(logging.ERROR):
        writer.admit(SimpleNamespace(request_id="broken"), 0, 0)  # no block_hashes
    assert "the log is off" in caplog.text
    writer.admit(request("r", chain("a", 2), 2 * BS + 1), 0, 0)
    assert writer.num_dropped == 1
    writer.close()


def test_a_failing_disk_turns_the_log_off(log_path, caplog):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)

    def full(data):
        raise OSError(28, "No space left on device")

    writer._file.write = full
    writer.admit(request("r", chain("a", 2), 2 * BS + 1), 0, 0)
    with caplog.at_level(logging.WARNING):
        writer.flush()
    assert "writing failed" in caplog.text
    writer.admit(request("r2", chain("b", 2), 2 * BS + 1), 0, 0)
    assert writer.num_dropped == 1
    writer.close()


# --- options -----------------------------------------------------------------------


def test_options_parse_and_default_off():
    cfg = make_config()
    assert cfg.hicache_access_log == "" and cfg.hicache_access_log_sample == 1.0
    cfg = make_config(hicache_access_log="/tmp/x.log", hicache_access_log_sample=0.25,
                      hicache_access_log_max_mb=64)
    assert (cfg.hicache_access_log, cfg.hicache_access_log_sample,
            cfg.hicache_access_log_max_mb) == ("/tmp/x.log", 0.25, 64.0)


@pytest.mark.parametrize("key,value", [
    ("hicache_access_log", 3),
    ("hicache_access_log_sample", 0),
    ("hicache_access_log_sample", 1.5),
    ("hicache_access_log_max_mb", 0),
    ("hicache_access_log_max_mb", float("inf")),
    ("hicache_access_log_max_mb", True),
])
def test_bad_options_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        make_config(**{key: value})


# --- the log of a real scheduler, replayed -------------------------------------------


def test_hits_the_load_gate_declined_are_recorded_apart_from_misses(log_path):
    writer = AccessLogWriter(log_path, HEADER, 10**6, flush_s=NO_TIMER_S)
    # L1 had block 0; L2 held blocks 1-3, and the gate chose to recompute them.
    writer.admit(request("d", chain("d", 4), 4 * BS + 1), BS, 0, declined_tokens=3 * BS)
    writer.admit(request("m", chain("m", 2), 2 * BS + 1), 0, 0)
    writer.close()
    declined, miss = read_log(log_path).records
    assert (declined.l1_tokens, declined.l2_tokens, declined.l3_tokens) == (BS, 0, 0)
    assert (declined.declined_tokens, declined.l3_stages_us, declined.l3_node_tokens) == (
        3 * BS, None, 0)
    assert miss.declined_tokens == 0
    # Written after nil stages and zero node tokens; without it, ten items as before.
    raw = msgpack.unpackb(encode_admit(5, 1, 2, BS, 0, 0, 0, 0, b"x" * HASH_BYTES,
                                       None, 0, 2 * BS), raw=False)
    assert raw[10:] == [None, 0, 2 * BS]
    assert len(msgpack.unpackb(encode_admit(5, 1, 2, BS, 0, 0, 0, 0, b"x" * HASH_BYTES),
                               raw=False)) == 10


def _multiturn_on_harness(h, seed: int, num_convs: int = 10, num_batches: int = 14) -> None:
    """Conversations growing turn by turn, in batches of 1-4 (vLLM's real
    scheduler, chunked prefill, an L1 smaller than the working set)."""
    import random

    rng = random.Random(seed)
    convs = {c: [3 + (c * 7 + i) % 300 for i in range(20 + 9 * c)] for c in range(num_convs)}
    n = 0
    for _ in range(num_batches):
        batch = rng.sample(sorted(convs), rng.randint(1, 4))
        for c in batch:
            h.add(f"r{n}-{c}", list(convs[c]), max_tokens=rng.randint(2, 20))
            convs[c] += [11 + (n * 13 + i) % 300 for i in range(rng.randint(10, 40))]
            n += 1
        h.run(max_steps=400)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("eviction,write,exact", [
    ("lru", "write_through", True),
    ("lfu", "write_through", True),
    ("lru", "write_through_selective", False),
    ("priority", "write_back", False),
])
def test_the_replay_of_a_scheduler_run_predicts_every_request(tiny_model_dir, tmp_path,
                                                             eviction, write, exact):
    """vLLM's real scheduler with the scheduler and worker halves (no model),
    chunked prefill and preemptions included: under write-through the
    replay at the served sizes gets every request's L1 and L2 hit exactly;
    the selective counter's and the write-back watcher's bounds are only
    approximated, so there the hit rate is right within a few points (one
    request of 36 differs under each in this run)."""
    from tests.connector.harness import make_harness
    from vllm_hicache.planner.report import CostModel, build_plan

    path = tmp_path / "access.log"
    h = make_harness(tiny_model_dir, num_blocks=24, hicache_ratio=1.5,
                     radix_eviction_policy=eviction, hicache_write_policy=write,
                     hicache_access_log=str(path))
    _multiturn_on_harness(h, seed=3)
    h.sched_half.access_log.close()
    log = read_logs([path])
    plan = build_plan(log, CostModel(), l2_gb=[], l3_gb=[])
    # Each request's first admission is what vLLM reported (re-admissions
    # after a preemption are logged too: they look the cache up again).
    first: dict[int, int] = {}
    for rec in log.records:
        if isinstance(rec, Admit):
            first.setdefault(rec.seq, rec.l1_tokens + rec.l2_tokens + rec.l3_tokens)
    assert list(first.values()) == list(h.first_computed.values())
    assert plan.measured.l2_tokens > 0 and plan.measured.l1_tokens > 0
    if exact:
        assert plan.served.result.per_request == plan.measured.per_request
    else:
        assert abs(plan.served.result.hit_rate - plan.measured.hit_rate) <= 0.05
