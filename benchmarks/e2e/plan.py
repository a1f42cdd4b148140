"""What the end-to-end benchmark runs: systems, workloads and their sizes.

Systems (same model, seeds, block size, batch limits and compute core):

==================  =====================================================
``vllm``            vLLM with prefix caching, L1 = ``l1_blocks``
``ideal``           vLLM with an L1 that holds every workload's working set
``hicache-l2``      + HiCache, L2 holds the working set (no L3)
``hicache-l2l3``    + HiCache, L2 = 2 x L1 (smaller than the working set)
                    and the ``file`` L3
``hicache-l3``      the ``hicache-l2l3`` server with L1 and L2 emptied
                    before every round: every hit of a round >= 2 is read
                    from L3 (session workloads only)
==================  =====================================================

The working set of every workload is several times L1. L3 systems use the
``timeout`` prefetch policy (SGLang's default: a request waits for its L3
pages, bounded) with a one-block prefetch threshold, and admit an L3 hit in
the step its read is sent (``same_step_read_wait_ms``: the L1 copy waits up
to 50 ms for the read; docs/design.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from e2e.servers import ServerSpec
from e2e.vllm_bench import BenchServeSpec
from e2e.workloads import WorkloadSpec


@dataclass(frozen=True)
class System:
    name: str
    server: str  # which ServerSpec serves it
    # "rounds": empty L1 + L2 before every round (hits only from L3).
    reset: str = ""
    label: str = ""


SYSTEMS = (
    System("vllm", "vllm", label="vLLM, prefix caching"),
    System("ideal", "ideal", label="vLLM, L1 holds everything"),
    System("hicache-l2", "hicache-l2", label="HiCache L2"),
    System("hicache-l2l3", "hicache-l2l3", label="HiCache L2 (< working set) + L3"),
    System("hicache-l3", "hicache-l2l3", reset="rounds", label="HiCache, all hits from L3"),
)

NO_REUSE_SYSTEMS = ("vllm", "hicache-l2", "hicache-l2l3")


@dataclass(frozen=True)
class Plan:
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_batched_tokens: int = 2048
    l1_blocks: int = 256
    l2l3_ratio: float = 2.0
    sessions: tuple[WorkloadSpec, ...] = ()
    bench: tuple[BenchServeSpec, ...] = ()
    systems: tuple[str, ...] = tuple(s.name for s in SYSTEMS)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def working_set_blocks(self) -> int:
        sizes = [w.working_set_blocks(self.block_size) for w in self.sessions]
        for b in self.bench:
            if b.dataset == "prefix_repetition":
                per_prompt = -(-(b.suffix_tokens + b.output_tokens) // self.block_size)
                sizes.append(b.num_prefixes * -(-b.prefix_tokens // self.block_size)
                             + b.num_prompts * per_prompt)
        return max(sizes)

    def ideal_blocks(self) -> int:
        """L1 of the ideal system: every working set plus 15%, in 64-block steps."""
        return -(-int(self.working_set_blocks() * 1.15) // 64) * 64

    def server_specs(self) -> dict[str, ServerSpec]:
        ideal = self.ideal_blocks()
        base = {"hicache_io_backend": "direct", "hicache_write_policy": "write_through"}
        l3 = {"hicache_storage_backend": "file",
              "hicache_storage_prefetch_policy": "timeout",
              "hicache_storage_backend_extra_config": {"prefetch_threshold": self.block_size,
                                                       "same_step_read_wait_ms": 50}}
        return {
            "vllm": ServerSpec("vllm", self.l1_blocks),
            "ideal": ServerSpec("ideal", ideal),
            "hicache-l2": ServerSpec("hicache-l2", self.l1_blocks,
                                     dict(base, hicache_ratio=round(ideal / self.l1_blocks, 3))),
            "hicache-l2l3": ServerSpec("hicache-l2l3", self.l1_blocks,
                                       dict(base, hicache_ratio=self.l2l3_ratio, **l3)),
        }

    def to_json(self) -> dict:
        return json.loads(json.dumps(self, default=lambda o: o.__dict__))


def full_plan(seed: int = 0) -> Plan:
    return Plan(
        sessions=(
            # 24 conversations, 5 rounds: 45 blocks each at the end, 4.2 x L1 in all.
            WorkloadSpec("multiturn", "multiturn", sessions=24, rounds=5, turn_tokens=256,
                         output_tokens=32, request_rate=2.0, seed=seed, repeats=2),
            # 16 documents of 1,536 tokens, each asked about once per round.
            WorkloadSpec("docqa", "docqa", sessions=16, rounds=4, turn_tokens=64,
                         output_tokens=32, doc_tokens=1536, request_rate=1.5, seed=seed,
                         repeats=2),
        ),
        bench=(
            BenchServeSpec("prefix_repetition", "prefix_repetition", num_prompts=64,
                           output_tokens=32, prefix_tokens=1536, suffix_tokens=64,
                           num_prefixes=16, request_rate=1.5, seed=seed),
            # No reuse ("ideal" is vLLM alone there): three runs each.
            BenchServeSpec("random-high", "random", num_prompts=32, output_tokens=64,
                           input_tokens=1024, max_concurrency=8, seed=seed, repeats=3,
                           systems=NO_REUSE_SYSTEMS),
            BenchServeSpec("random-low", "random", num_prompts=12, output_tokens=64,
                           input_tokens=1024, request_rate=0.4, seed=seed, repeats=3,
                           systems=NO_REUSE_SYSTEMS),
        ),
    )


def quick_plan(seed: int = 0) -> Plan:
    """``make bench``: the same systems and clients, small enough for a few minutes."""
    return Plan(
        l1_blocks=64, max_num_seqs=4, max_model_len=1024,
        sessions=(
            WorkloadSpec("multiturn", "multiturn", sessions=6, rounds=3, turn_tokens=192,
                         output_tokens=16, request_rate=4.0, seed=seed),
        ),
        bench=(
            BenchServeSpec("random-high", "random", num_prompts=8, output_tokens=16,
                           input_tokens=512, max_concurrency=4, seed=seed,
                           systems=NO_REUSE_SYSTEMS),
        ),
    )


def with_systems(plan: Plan, names: list[str]) -> Plan:
    known = {s.name for s in SYSTEMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {sorted(known)}")
    return replace(plan, systems=tuple(n for n in plan.systems if n in names))
