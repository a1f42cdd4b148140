"""The node-tier benchmark's engine processes (benchmarks/node_tier): an
instance on the node tier answers, counts its hits per tier, survives a bad
command, and one that cannot start says why instead of leaving the
benchmark waiting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_node_tier as bench  # noqa: E402
from node_tier import plan as P  # noqa: E402
from node_tier.fleet import Instance, InstanceError  # noqa: E402

from tests.tmpfs import tmpfs_dir  # noqa: E402

pytestmark = pytest.mark.engine


def spec(model: Path, plan: P.Plan, extra: dict | None) -> dict:
    return {"model": str(model), "extra": extra, "block_tokens": P.BLOCK_TOKENS,
            "l1_blocks": plan.l1_blocks, "page_bytes": plan.page_bytes,
            "max_model_len": plan.max_model_len}


def test_an_instance_that_cannot_start_says_why(tmp_path):
    plan = P.quick(196_608)
    inst = Instance("broken", spec(tmp_path / "no-model", plan, None), tmp_path / "logs")
    try:
        with pytest.raises(InstanceError, match=r"broken ended \(rc [1-9]"):
            inst.wait_ready()
    finally:
        inst.stop()


def _run_node_instance(tiny_model_dir, tmp_path, plan, root: str) -> Instance:
    inst = Instance("node", spec(tiny_model_dir, plan, bench.extras(plan, root)[bench.NODE]),
                    tmp_path / "logs")
    try:
        inst.wait_ready()
        doc = P.documents(plan, "test")[0]
        first = bench.ask(inst, doc + P.question(plan, 1))
        assert first["cached"] == 0 and len(first["answer"]) == P.ANSWER_TOKENS
        inst.call("settle")
        inst.call("reset_l1")
        again = bench.ask(inst, doc + P.question(plan, 2))
        assert again["cached"] == P.reusable_tokens(len(again["prompt"]))  # from L2
        hits, _ = bench.tier_hits([inst])
        assert hits["L2"] == again["cached"]
        assert hits["load errors (blocks)"] == 0
        assert bench.allocated_bytes(root) > 0  # the tier's files exist
        with pytest.raises(InstanceError, match="unknown op 'nope'"):
            inst.call("nope")
        assert bench.ask(inst, doc + P.question(plan, 2))["answer"] == again["answer"]
    finally:
        inst.stop()
    return inst


def test_a_node_tier_instance_answers_and_counts_its_hits(tiny_model_dir, tmp_path):
    plan = P.quick(bench.page_bytes(tiny_model_dir))
    with tmpfs_dir("hicache-node-bench-") as root_dir:
        inst = _run_node_instance(tiny_model_dir, tmp_path, plan, str(root_dir))
    assert inst.proc.returncode == 0
