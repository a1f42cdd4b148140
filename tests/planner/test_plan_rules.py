"""The capacity plan's comparison of admission rules and L3 modes
(planner/rules.py): each rule replayed at the served sizes, with hit rate
and bytes written per boundary, and the CLI options that choose them."""

from __future__ import annotations

import pytest

from tests.planner.logs import BS
from tests.planner.test_plan import multiturn
from vllm_hicache.planner.__main__ import main
from vllm_hicache.planner.report import CostModel, build_plan
from vllm_hicache.planner.rules import Rules, rule_grid
from vllm_hicache.policy.admission import L3Mode, parse_admission

L3 = dict(l3_backend="file", l3_prefetch_policy="wait_complete", l3_threshold_tokens=BS,
          l3_block_bytes=1000)


def rules(l2: str, l3: str, mode: str) -> Rules:
    return Rules(parse_admission(l2), parse_admission(l3), L3Mode(mode))


def test_the_grid_starts_with_the_served_rules():
    b = multiturn(l1_blocks=3, l2_pages=6, l3_capacity_bytes=12_000, **L3)
    grid = rule_grid(b.header)
    assert grid[0] == rules("always", "always", "inclusive")
    assert len(grid) == 8 and len(set(grid)) == 8
    no_l3 = rule_grid(multiturn().header)
    assert no_l3 == [rules("always", "always", "inclusive"), rules("hits:2", "always", "inclusive")]
    selective = rule_grid(multiturn(write_policy="write_through_selective", l2_admission="hits:2",
                                    **L3).header)
    assert {r.l2 for r in selective} == {parse_admission("hits:2")}


def test_each_rule_is_replayed_with_bytes_written_per_boundary():
    """Conversations whose working set exceeds L2 + L3: exclusive mode keeps
    more distinct blocks (hit rate at least inclusive's) and writes less to
    L3; hits:2 at L2->L3 writes less than always."""
    b = multiturn(num_convs=8, turns=5, l1_blocks=3, l2_pages=6, l3_capacity_bytes=10_000, **L3)
    plan = build_plan(b.log(), CostModel(), l2_gb=[], l3_gb=[])
    by = {p.rules: p for p in plan.rules}
    assert plan.rules[0].served
    incl, excl = by[rules("always", "always", "inclusive")], by[rules("always", "always",
                                                                       "exclusive")]
    assert excl.result.hit_rate >= incl.result.hit_rate
    assert excl.l3_bytes < incl.l3_bytes
    assert incl.l3_bytes == incl.result.l3_written * 1000
    assert incl.l2_bytes == incl.result.stored_pages * 1000
    twice = by[rules("always", "hits:2", "inclusive")]
    assert twice.l3_bytes < incl.l3_bytes
    l2_twice = by[rules("hits:2", "always", "inclusive")]
    assert l2_twice.l2_bytes < incl.l2_bytes


def test_cli_compares_the_rules_asked_for(tmp_path, capsys):
    path = multiturn(l1_blocks=3, l2_pages=6, **L3).write(tmp_path / "log")
    assert main([str(path), "--no-plots", "--l2-gb", "1e-5", "--l3-gb", "1e-5",
                 "--l2-admission", "always", "--l3-admission", "hits:3,value:64",
                 "--l3-mode", "exclusive"]) == 0
    out = capsys.readouterr().out
    assert "Admission rules and L3 mode" in out
    assert "hits:3     exclusive" in out and "value:64   exclusive" in out
    assert "hits:2" not in out.split("Admission rules")[1]


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--l3-admission", "hits:0", "N >= 1"),
    ("--l2-admission", "often", "unknown admission rule"),
    ("--l3-mode", "victim", "inclusive, exclusive"),
])
def test_cli_names_a_bad_rule(tmp_path, capsys, flag, value, says):
    path = multiturn().write(tmp_path / "log")
    with pytest.raises(SystemExit) as exit_:
        main([str(path), "--no-plots", flag, value])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
