"""The scheduler half's cost: time inside HiCacheConnector's scheduler-side
methods while vLLM's real ``Scheduler`` runs a trace (no model, no worker).

Set-up, trace and fake worker are benchmarks/bench_scheduler.py's, at its
default shape: 64 requests of 4096 tokens in 8 groups sharing 3072, 8 decode
tokens, block 16. Its warm-up round (L2 empty: stores only) runs in the
fixture. A benchmark round is then a pair of trace rounds, one with fresh
suffixes and one repeating it, each after vLLM's prefix cache is reset, so
every round loads its prefixes from L2 and every pair does the same work.

What is timed is the connector alone: the benchmark's timer is a clock that
advances only inside the connector's methods (bench_scheduler.py wraps each
with a perf_counter accumulator), so vLLM's own ``schedule()`` and
``update_from_output()``, about four fifths of a step, neither dilute a
regression nor add their noise. ``extra_info`` has the per-step figure
bench_scheduler.py reports and vLLM's time as context.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from bench_scheduler import (  # noqa: E402
    REPO,
    RoundStats,
    Timers,
    build_scheduler,
    build_trace,
    play_round,
    wrap_connector,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402

# The one place this suite names the scheduler half: vLLM loads the connector
# by class name from this module path, as a deployment's kv_connector_module_path
# does, so the modules behind it may move without touching this suite.
CONNECTOR, CONNECTOR_MODULE = "HiCacheConnector", "vllm_hicache"

TRACE = SimpleNamespace(
    model=str(REPO / ".cache" / "tiny-llama"), requests=64, prompt_len=4096, prefix_len=3072,
    groups=8, decode_tokens=8, block_size=16, max_batched_tokens=2048, seed=0,
    max_steps_per_round=2000)
PAIRS, WARMUP_PAIRS = 6, 1

# The clock's source: the Timers of the scheduler the running benchmark uses.
_current: list[Timers] = []


def connector_clock() -> float:
    """Seconds spent so far inside the connector's scheduler-side methods."""
    return sum(_current[0].per_method.values()) if _current else 0.0


pytestmark = pytest.mark.benchmark(group="scheduler half", timer=connector_clock)


class Replay:
    """One scheduler with the connector, stepping through the trace's rounds."""

    def __init__(self, load_mode: str) -> None:
        if not (REPO / ".cache" / "tiny-llama" / "config.json").exists():
            pytest.fail("the tiny model is missing: run `make .cache/tiny-llama/.complete`")
        init_none_hash(sha256)
        self.args = SimpleNamespace(**vars(TRACE), rounds=2 * (PAIRS + WARMUP_PAIRS))
        self.args.gpu_blocks = self.args.requests * -(
            -(self.args.prompt_len + self.args.decode_tokens) // self.args.block_size) + 1024
        self.trace = build_trace(self.args)
        extra = {"hicache_io_backend": "direct", "hicache_ratio": 4.0,
                 "hicache_load_mode": load_mode}
        self.sched = build_scheduler(self.args, CONNECTOR, extra, CONNECTOR_MODULE)
        self.timers = Timers()
        wrap_connector(self.sched.connector, self.timers)
        self.hasher = get_request_block_hasher(self.args.block_size, sha256)
        self.played: list[tuple[RoundStats, float, list[float]]] = []
        self.play()  # the warm-up round: stores only

    def play(self) -> None:
        r = len(self.played)
        if r > 0 and not self.sched.reset_prefix_cache():
            raise RuntimeError(f"reset_prefix_cache() failed before round {r}")
        self.played.append(play_round(
            self.sched, self.hasher, self.trace.rounds[r], self.trace.decode_tokens, "hicache",
            self.timers, self.args.max_steps_per_round, f"round {r}"))

    def play_pair(self) -> None:
        self.play()
        self.play()


@pytest.fixture(params=["layerwise", "async"])
def replay(request) -> Replay:
    replay = Replay(request.param)
    _current.append(replay.timers)
    yield replay
    _current.clear()


def test_connector_per_round_pair(benchmark, replay: Replay) -> None:
    benchmark.pedantic(replay.play_pair, rounds=PAIRS, warmup_rounds=WARMUP_PAIRS)
    timed = replay.played[1 + 2 * WARMUP_PAIRS:]
    assert len(timed) == 2 * PAIRS
    idle = [r for r, (stats, _, _) in enumerate(timed) if stats.loaded_blocks == 0]
    assert not idle, f"timed rounds {idle} loaded nothing from L2"
    steps = [s for _, _, step_s in timed for s in step_s]
    vllm_s = sum(sched_s for _, sched_s, _ in timed)
    benchmark.extra_info.update(
        steps_per_pair=len(steps) / PAIRS,
        connector_us_per_step=sum(steps) / len(steps) * 1e6,
        share_of_schedule_and_update=sum(steps) / vllm_s,
        loaded_blocks_per_pair=sum(stats.loaded_blocks for stats, _, _ in timed) / PAIRS)
