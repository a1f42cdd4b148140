"""hicache_l2_admission, hicache_l3_admission, hicache_l3_mode in the
configuration: parsed once, contradictions refused by name."""

from __future__ import annotations

import pytest

from tests.conftest import make_config
from vllm_hicache.policy.admission import ALWAYS, L3Mode, parse_admission

L3 = dict(hicache_storage_backend="file",
          hicache_storage_backend_extra_config={"storage_dir": "/tmp/x"})


def test_defaults_are_today():
    cfg = make_config()
    assert cfg.hicache_l2_admission == ALWAYS and cfg.hicache_l3_admission == ALWAYS
    assert cfg.hicache_l3_mode == L3Mode.INCLUSIVE
    assert cfg.l2_admission() == ALWAYS


def test_rules_are_parsed_once():
    cfg = make_config(hicache_l2_admission="hits:3", hicache_l3_admission="value:512",
                      hicache_l3_mode="exclusive", **L3)
    assert cfg.l2_admission() == parse_admission("hits:3")
    assert cfg.hicache_l3_admission == parse_admission("value:512")
    assert cfg.hicache_l3_mode == L3Mode.EXCLUSIVE


def test_selective_keeps_its_meaning():
    cfg = make_config(hicache_write_policy="write_through_selective")
    assert cfg.l2_admission() == parse_admission("hits:2")
    same = make_config(hicache_write_policy="write_through_selective",
                       hicache_l2_admission="hits:2")
    assert same.l2_admission() == parse_admission("hits:2")
    with pytest.raises(ValueError, match="cannot be combined with hicache_l2_admission=always"):
        make_config(hicache_write_policy="write_through_selective", hicache_l2_admission="always")


def test_bad_values_name_the_key():
    with pytest.raises(ValueError, match="hicache_l3_admission='hits:0'"):
        make_config(hicache_l3_admission="hits:0", **L3)
    with pytest.raises(ValueError, match="hicache_l3_mode='victim'.*inclusive, exclusive"):
        make_config(hicache_l3_mode="victim", **L3)


def test_l3_rules_need_an_l3():
    with pytest.raises(ValueError, match="hicache_l3_mode set without an L3 backend"):
        make_config(hicache_l3_mode="exclusive")
    # An L3 attached at run time over the admin API gets them.
    cfg = make_config(hicache_l3_admission="hits:2", admin_api_port=18080,
                      admin_api_key="none")
    assert cfg.hicache_l3_admission == parse_admission("hits:2")


def test_write_back_takes_no_l2_rule():
    with pytest.raises(ValueError, match="write_back.*hits:2"):
        make_config(hicache_write_policy="write_back", hicache_l2_admission="hits:2")
