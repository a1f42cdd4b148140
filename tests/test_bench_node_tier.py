"""The node-tier benchmark's pure parts (benchmarks/node_tier, and the
report of benchmarks/bench_node_tier.py): the plan's sizes are refused when
they would not compare what the benchmark claims, the rotation sends every
document to another instance each round, the hit rate counts only reusable
tokens, and host memory is read as PSS from /proc."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_node_tier as bench  # noqa: E402
from node_tier import plan as P  # noqa: E402
from node_tier.pss import allocated_bytes, descendants, parse_rollup_kib, pss_bytes  # noqa: E402

PAGE = 196_608


@pytest.mark.parametrize("plan", [P.Plan(page_bytes=PAGE), P.quick(PAGE)])
def test_the_default_and_quick_plans_fit_s_but_not_a_third(plan):
    plan.check()
    assert plan.node_pages // 3 < plan.working_set_pages <= plan.node_pages
    # A document, its question and answer fit the model length.
    assert plan.doc_blocks * P.BLOCK_TOKENS + P.QUESTION_TOKENS + P.ANSWER_TOKENS \
        <= plan.max_model_len
    # The question and answer stay in the document's last, partial block.
    assert P.QUESTION_TOKENS + P.ANSWER_TOKENS < P.BLOCK_TOKENS


@pytest.mark.parametrize("kwargs, words", [
    ({"docs": 4}, "must fit S"),            # 96 pages: fits S/3
    ({"docs": 13}, "must fit S"),           # 312 pages: does not fit S
    ({"l1_blocks": 20}, "cannot hold one request"),
    ({"staging_ratio": 1.5}, "node-tier hits would be cut short"),
    ({"l1_blocks": 200}, "the hits would be L1's"),
    ({"rounds": 1}, "rounds must be >= 2"),
])
def test_a_plan_that_would_not_compare_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        P.Plan(page_bytes=PAGE, **kwargs).check()


def test_the_rotation_asks_every_document_each_round_on_the_next_instance():
    plan = P.Plan(page_bytes=PAGE)
    order = P.rotation(plan)
    assert len(order) == plan.rounds * plan.docs
    last: dict[int, int] = {}
    for r, d, i in order:
        if r > 0:
            assert i == (last[d] + 1) % P.INSTANCES
        last[d] = i
    for r in range(plan.rounds):
        assert sorted(d for rr, d, _ in order if rr == r) == list(range(plan.docs))


def test_prompts_are_the_same_for_the_same_place_and_differ_elsewhere():
    plan = P.quick(PAGE)
    assert P.documents(plan, "a") == P.documents(plan, "a")
    assert P.documents(plan, "a") != P.documents(plan, "b")
    assert P.question(plan, "x", 1) == P.question(plan, "x", 1) != P.question(plan, "x", 2)
    assert all(P.FIRST_WORD_ID <= t < P.FIRST_WORD_ID + P.NUM_WORDS
               for doc in P.documents(plan, "a") for t in doc)


def test_the_hit_rate_counts_the_reusable_tokens_after_the_first_round():
    served = [
        {"round": 0, "prompt_len": 784, "cached": 0},      # cold: not counted
        {"round": 1, "prompt_len": 784, "cached": 768},
        {"round": 1, "prompt_len": 784, "cached": 384},
        {"round": 2, "prompt_len": 784, "cached": 800},    # capped at the reusable 768
    ]
    assert P.reusable_tokens(784) == 768
    assert P.reusable_tokens(769) == 768 and P.reusable_tokens(768) == 736
    assert P.hit_rate(served) == (768 + 384 + 768, 3 * 768)


def test_median():
    assert P.median([3.0, 1.0, 2.0]) == 2.0
    assert P.median([4.0, 1.0, 2.0, 3.0]) == 2.5


ROLLUP = """55d0c0a8e000-7ffd1f1fd000 ---p 00000000 00:00 0                          [rollup]
Rss:              123456 kB
Pss:               65536 kB
Pss_Anon:          40000 kB
Shared_Clean:       1000 kB
"""


def fake_proc(tmp_path: Path, tree: dict[int, list[int]], pss_kib: dict[int, int]) -> Path:
    for pid, children in tree.items():
        task = tmp_path / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, children)))
        if pid in pss_kib:
            (tmp_path / str(pid) / "smaps_rollup").write_text(
                ROLLUP.replace("65536", str(pss_kib[pid])))
    return tmp_path


def test_rollup_lines_are_read_in_kib():
    fields = parse_rollup_kib(ROLLUP)
    assert fields["Pss"] == 65536 and fields["Rss"] == 123456
    assert "55d0c0a8e000-7ffd1f1fd000 ---p 00000000 00" not in fields


def test_pss_sums_the_processes_and_their_children(tmp_path):
    proc = fake_proc(tmp_path, {10: [11], 11: [12], 12: [], 20: []},
                     {10: 100, 11: 10, 12: 1, 20: 1000})
    assert sorted(descendants(10, proc)) == [10, 11, 12]
    assert pss_bytes([10, 20], proc) == (100 + 10 + 1 + 1000) * 1024


def test_a_process_whose_memory_cannot_be_read_is_an_error_not_zero(tmp_path):
    proc = fake_proc(tmp_path, {10: []}, {})
    with pytest.raises(ValueError, match="smaps_rollup"):
        pss_bytes([10], proc)


def test_pss_of_this_process_is_read_from_the_real_proc():
    if not Path(f"/proc/{os.getpid()}/smaps_rollup").exists():
        pytest.skip("no smaps_rollup on this kernel")
    assert pss_bytes([os.getpid()]) > 1 << 20


def test_allocated_bytes_counts_what_files_hold(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"x" * 100_000)
    assert allocated_bytes(str(tmp_path)) >= 100_000


def test_the_hit_path_is_read_from_the_counters():
    assert "private L2" in bench.hit_path({"L2": 0, "L3": 768}, reads=24)
    assert bench.hit_path({"L2": 0, "L3": 0}, reads=0) == "no page was read from the node tier"
    # A tier label the current path does not produce is shown as it is.
    other = bench.hit_path({"L2": 0, "node": 768}, reads=24)
    assert "'node': 768" in other
    # Hits loaded from the segment straight into L1 are told apart from staged ones.
    # Direct loads are not the staging path's page reads: counted on their own.
    direct = bench.hit_path({"L2": 0, "L3": 768, bench.DIRECT: 24}, reads=0)
    assert direct.startswith("segment -> L1 directly (24 pages")


def test_the_report_states_every_target_as_a_ratio():
    plan = P.quick(PAGE)
    hit = {bench.NODE: {"hit": 950, "reusable": 1000, "by_tier": {"L3": 900.0}, "node_reads": 30},
           bench.SMALL: {"hit": 0, "reusable": 1000, "by_tier": {}, "node_reads": 0}}
    s = plan.node_pages * PAGE
    alone = 3 * 500 * 2**20
    mem = {bench.ALONE: alone, bench.NODE: alone + s, bench.SMALL: alone + s,
           bench.LARGE: alone + 3 * s, "node tier files": s}
    ttft = {"l2": [0.10, 0.12], "cross": [0.11, 0.12], "cold": [0.5, 0.5],
            "b_by_tier": {"L3": 768.0}, "b_node_reads": 24.0, "short": [],
            "parts": {"L2": [(0.0, 0.09), (0.002, 0.11)], "node": [(0.001, 0.1), (0.001, 0.12)]}}
    text = "\n".join(bench.report(plan, hit, mem, ttft, differ=0, total=10))
    assert "cross-instance hit TTFT / same-instance L2 hit TTFT: 1.05" in text
    assert ("L2 hit: waiting before the step that admits it 1.0 ms, that step to the first "
            "token 100.0 ms (medians)") in text
    assert ("cross-instance hit: waiting before the step that admits it 1.0 ms, that step to "
            "the first token 110.0 ms (medians)") in text
    assert "node tier's hit rate: 95.0% of the reusable tokens (private L2 of S/3: 0.0%)" in text
    assert "node tier / three private L2s of S: 0.33; node tier 1.00 x S" in text
    assert "answers identical to vLLM alone: yes (10 requests)" in text
    assert "hits short of the whole document: none" in text
    bad = "\n".join(bench.report(plan, hit, mem, ttft, differ=2, total=10))
    assert "NO (2 of 10 differ)" in bad


def test_the_node_tier_s_memory_is_split_into_its_pages_and_each_instance_s_rest():
    s = 100 * 2**20
    line = bench.memory_split(s + 3 * 40 * 2**20, s, s)
    assert "the tier's pages 100.0 MiB (1.00 x S, once for the machine)" in line
    assert "40.0 MiB per instance beside them" in line
    assert "from S = 0.78 GiB on" in line  # 40 MiB is 5% of 800 MiB
    # Nothing beside the tier's pages: no negative rest.
    assert "0.0 MiB per instance" in bench.memory_split(s - 2**20, s, s)
