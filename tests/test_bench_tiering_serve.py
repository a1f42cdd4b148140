"""benchmarks/bench_tiering_serve.py without servers: it replays
bench_admission's trace (the same conversation picks), builds each turn's
prompt from the conversation so far and the server's answer, reads the
tiering series off a /metrics page, and refuses sizes the server could
not run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_admission  # noqa: E402
import bench_tiering_serve as bench  # noqa: E402


def test_prompts_follow_the_trace_and_carry_the_answers():
    args = bench.parse_args(["--requests", "40", "--conversations", "3", "--max-turns", "2"])
    convs = bench.Conversations(args)
    seen: dict[int, list[int]] = {}
    picks = list(bench_admission.picks(args))
    assert len(picks) == 40 and any(not fresh for _, _, fresh in picks)
    for seq, conv, fresh in picks:
        prompt = convs.prompt(seq, conv, fresh)
        assert len(prompt) % bench.BLOCK_SIZE == 0
        assert prompt[: len(convs.system)] == convs.system  # the shared system prompt
        if not fresh:  # the conversation so far, the answer included, is its prefix
            assert prompt[: len(seen[conv])] == seen[conv]
        answer = [7 + seq % 5] * args.turn_blocks * bench.BLOCK_SIZE
        convs.answered(seq, conv, prompt, answer)
        seen[conv] = prompt + answer
    # Restarts after max_turns: no conversation grows past it.
    longest = (args.system_blocks + 1 + 2 * args.max_turns * args.turn_blocks) * bench.BLOCK_SIZE
    assert max(map(len, seen.values())) <= longest


def test_tiering_series_are_read_and_summed_over_engines():
    page = "\n".join([
        "# TYPE vllm:hicache_store_skipped_blocks_total counter",
        'vllm:hicache_store_skipped_blocks_total{engine="0",model_name="demo",reason='
        '"write_budget",tier="L3"} 3.0',
        'vllm:hicache_store_skipped_blocks_total{engine="1",model_name="demo",reason='
        '"write_budget",tier="L3"} 2.0',
        'vllm:hicache_admission_declined_blocks_total{engine="0",model_name="demo",'
        'rule="hits",tier="L3"} 9.0',
        'vllm:num_requests_running{model_name="demo"} 1.0',
        'vllm:hicache_admission_declined_blocks_created{engine="0",model_name="demo",'
        'rule="hits",tier="L3"} 1796190955.5',
    ])
    series = bench.parse_series(page)
    assert series == {
        "vllm:hicache_store_skipped_blocks_total{reason=write_budget,tier=L3}": 5.0,
        "vllm:hicache_admission_declined_blocks_total{rule=hits,tier=L3}": 9.0}
    assert bench.skipped_by_reason(series) == {"L3/write_budget": 5}


def test_synthetic_answers_replace_the_servers_and_are_the_same_everywhere():
    """With --answers synthetic a turn continues with a made-up block, not
    what the server said, so every server gets the same prompts whatever it
    answers, and the few tokens generated never complete a block."""
    args = bench.parse_args(["--requests", "30", "--conversations", "3",
                             "--answers", "synthetic"])
    assert bench.CHECK_TOKENS < bench.BLOCK_SIZE
    runs = []
    for said in ([1, 2, 3, 4], [9, 9, 9, 9]):
        convs = bench.Conversations(args)
        prompts = []
        for seq, conv, fresh in bench_admission.picks(args):
            prompt = convs.prompt(seq, conv, fresh)
            convs.answered(seq, conv, prompt, said)
            prompts.append(prompt)
        runs.append(prompts)
    assert runs[0] == runs[1]
    assert all(len(p) % bench.BLOCK_SIZE == 0 for p in runs[0])
    assert not any(p[i:i + 4] in ([1, 2, 3, 4], [9, 9, 9, 9])
                   for p in runs[0] for i in range(len(p) - 3))


def test_a_throttled_store_serves_every_configuration_and_sets_the_budget():
    args = bench.parse_args(["--l3-write-mb-s", "0.5", "--configs", "write-through,budget"])
    for name, budget in (("write-through", 0), ("budget", 250_000)):
        cfg = bench.hicache_config(args, name, 65536, budget)
        storage = cfg["hicache_storage_backend_extra_config"]
        assert cfg["hicache_storage_backend"] == "dynamic"
        assert storage["class_name"] == "ThrottledFileBackend" and storage["write_mb_s"] == 0.5
        assert storage.get("l3_write_budget_bytes_per_s", 0) == budget
    # Half a slow store's bandwidth may be under a block a second: the burst
    # then holds two blocks, or the connector refuses the budget.
    slow = bench.hicache_config(args, "budget", 196608, 125_000)
    storage = slow["hicache_storage_backend_extra_config"]
    assert storage["l3_write_burst_bytes"] >= 2 * 196608
    assert "l3_write_burst_bytes" not in bench.hicache_config(
        args, "budget", 65536, 250_000)["hicache_storage_backend_extra_config"]
    plain = bench.hicache_config(bench.parse_args([]), "write-through", 65536, 0)
    assert plain["hicache_storage_backend"] == "file"


@pytest.mark.parametrize("argv, needle", [
    (["--configs", "write-through,nope"], "unknown ['nope']"),
    (["--l3-write-mb-s", "-1"], "--l3-write-mb-s must be >= 0"),
    (["--answers", "echo"], "invalid choice: 'echo'"),
    (["--parallel", "--configs", "write-through,budget"], "--parallel with budget"),
    (["--max-turns", "20"], "over max_model_len"),
    (["--l1-blocks", "24"], "--l1-blocks must exceed"),
])
def test_bad_arguments_are_refused_by_name(argv, needle, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_the_base_runs_first():
    assert bench.parse_args(["--configs", "hits2,write-through"]).configs == \
        ["write-through", "hits2"]
