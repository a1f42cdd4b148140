"""A runtime switch of the write policy over the admin API keeps the
configured L1->L2 admission rule's contract: write_through_selective is
hits:2, so with another hicache_l2_admission it is refused by name (400),
and the policy in force is unchanged."""

from __future__ import annotations

import uuid

from tests.admin.test_storage_control import control, settle
from tests.connector.harness import BLOCK, make_harness
from vllm_hicache.admin.api import parse_attach


def test_selective_is_refused_with_another_l2_rule(tiny_model_dir):
    h = make_harness(
        tiny_model_dir, hicache_l2_admission="hits:3",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config={
            "module_path": "tests.connector.mem_backend", "class_name": "MemBackend",
            "store": uuid.uuid4().hex, "prefetch_threshold": BLOCK},
    )
    assert str(h.sched_half.stores.write_policy.rule) == "hits:3"
    status, body = settle(h, control(h).submit("attach", parse_attach(
        {"backend": "dynamic", "write_policy": "write_through_selective"})))
    assert status == 400 and body["field"] == "write_policy"
    assert "hicache_l2_admission=hits:3" in body["error"]
    assert h.sched_half.write_policy == "write_through"
    assert str(h.sched_half.stores.write_policy.rule) == "hits:3"
