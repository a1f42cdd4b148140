"""Admission rules (policy/admission.py): the grammar, each rule, prefix
closure under value:, and write_through_selective as the rule hits:2."""

from __future__ import annotations

import pytest

from vllm_hicache.policy.admission import (
    ALWAYS,
    Admission,
    AdmissionKind,
    AdmissionRule,
    block_value,
    parse_admission,
)
from vllm_hicache.policy.write import SELECTIVE_RULE, WritePolicy, l2_admission_rule


@pytest.mark.parametrize(("text", "rule"), [
    ("always", ALWAYS),
    (" Always ", ALWAYS),
    ("hits:2", AdmissionRule(AdmissionKind.HITS, min_hits=2)),
    ("hits:1", AdmissionRule(AdmissionKind.HITS, min_hits=1)),
    ("value:4096", AdmissionRule(AdmissionKind.VALUE, min_value=4096.0)),
    ("value:1.5e3", AdmissionRule(AdmissionKind.VALUE, min_value=1500.0)),
])
def test_grammar(text, rule):
    parsed = parse_admission(text)
    assert parsed == rule
    assert parse_admission(str(parsed)) == parsed  # prints as it parses


@pytest.mark.parametrize(("text", "says"), [
    ("hits:0", "N >= 1"),
    ("hits:two", "bad admission rule"),
    ("hits", "unknown admission rule"),
    ("value:0", "V > 0"),
    ("value:-3", "V > 0"),
    ("value:inf", "finite"),
    ("sometimes", "unknown admission rule"),
    (2, "is a string"),
])
def test_bad_rules_are_named(text, says):
    with pytest.raises(ValueError, match=says) as err:
        parse_admission(text)
    assert "always" in str(err.value) or "N >= 1" in str(err.value) or "V > 0" in str(err.value)


def test_rules_admit_by_hits_or_value():
    assert ALWAYS.admits(0, 16)
    two = parse_admission("hits:2")
    assert not two.admits(1, 10_000) and two.admits(2, 16)
    val = parse_admission("value:64")
    assert block_value(2, 32) == 64
    assert val.admits(2, 32) and not val.admits(1, 32) and val.admits(1, 64)
    assert not ALWAYS.counts_hits and not parse_admission("hits:1").counts_hits
    assert two.counts_hits and val.counts_hits


def test_hits_filters_block_by_block():
    adm = Admission(parse_admission("hits:2"), 16, block_size=16)
    chain = [b"a", b"b", b"c"]
    adm.record_use(chain)
    adm.record_use(chain[:1])
    adm.record_use(chain[2:])  # only as a lost prefix could: filtered, not closed
    assert adm.select(chain, [0, 1, 2]) == [0, 2]


def test_value_admits_the_prefix_of_what_it_admits():
    # Block i ends a prefix of (i + 1) x 16 tokens: one use of block 2 is
    # worth 48, of block 0 only 16.
    adm = Admission(parse_admission("value:40"), 16, block_size=16)
    chain = [b"a", b"b", b"c", b"d"]
    adm.record_use(chain[:3])
    assert adm.value(chain, 0) == 16 and adm.value(chain, 2) == 48
    assert adm.select(chain, [0, 1, 2, 3]) == [0, 1, 2]  # d was never used
    assert adm.select(chain, [1, 3]) == []  # b: 32 < 40
    assert adm.select(chain, [0, 2]) == [0, 2]
    assert adm.select(chain, [3]) == []


def test_hit_counts_are_bounded():
    adm = Admission(parse_admission("hits:2"), 2, block_size=16)
    adm.record_use([b"a", b"a"])
    adm.record_use([b"b", b"c"])  # a is forgotten
    assert adm.hits(b"a") == 0 and adm.hits(b"b") == 1
    adm.clear()
    assert adm.hits(b"b") == 0


def test_selective_is_hits_2_and_takes_no_other_rule():
    assert l2_admission_rule("write_through_selective", None) == SELECTIVE_RULE
    assert l2_admission_rule("write_through_selective", SELECTIVE_RULE) == SELECTIVE_RULE
    with pytest.raises(ValueError, match="write_through_selective.*hits:3"):
        l2_admission_rule("write_through_selective", parse_admission("hits:3"))
    with pytest.raises(ValueError, match="write_back.*value:10"):
        l2_admission_rule("write_back", parse_admission("value:10"))
    assert l2_admission_rule("write_back", None) == ALWAYS
    assert l2_admission_rule("write_through", None) == ALWAYS


def test_write_through_with_a_rule_stores_what_the_rule_admits():
    policy = WritePolicy("write_through", 8, parse_admission("hits:3"), block_size=16)
    chain = [b"a", b"b"]
    policy.record_use(chain)
    policy.record_use(chain)
    assert policy.select(chain, [0, 1]) == []
    policy.record_use(chain[:1])
    assert policy.select(chain, [0, 1]) == [0]
    assert policy.threshold == 3
    value = WritePolicy("write_through", 8, parse_admission("value:32"), block_size=16)
    value.record_use(chain)
    assert value.select(chain, [0, 1]) == [0, 1]  # b: 1 x 32; a comes with it
