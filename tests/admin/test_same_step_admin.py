"""The admin API refuses same_step_read_wait_ms where this engine would not
use it (l3/same_step.py): an attach on an async-load engine, and a policy
update to best_effort while the option is on."""

from __future__ import annotations

import uuid

from tests.admin.test_storage_control import ALLOW_MEM, control, settle
from tests.connector.harness import make_harness
from tests.l3.test_planner import l3_harness
from vllm_hicache.admin.api import parse_attach


def test_an_async_engine_refuses_it_at_attach(tiny_model_dir):
    h = make_harness(tiny_model_dir, hicache_load_mode="async")
    spec = parse_attach({
        "backend": "dynamic", "prefetch_policy": "wait_complete",
        "extra_config": {"module_path": "tests.connector.mem_backend",
                         "class_name": "MemBackend", "store": uuid.uuid4().hex,
                         "same_step_read_wait_ms": 20},
    }, policy=ALLOW_MEM)
    status, body = settle(h, control(h).submit("attach", spec))
    assert status == 400, body
    assert "same_step_read_wait_ms" in body["error"] and "async" in body["error"]
    assert h.sched_half.l3 is None


def test_switching_to_best_effort_with_it_on_is_refused(tiny_model_dir):
    h, _ = l3_harness(tiny_model_dir, same_step_read_wait_ms=20)
    planner = h.sched_half.l3
    spec = parse_attach({"backend": "dynamic", "prefetch_policy": "best_effort"},
                        policy=ALLOW_MEM)
    status, body = settle(h, control(h).submit("attach", spec))
    assert status == 400, body
    assert "best_effort" in body["error"]
    assert h.sched_half.l3 is planner and planner.cfg.prefetch_policy == "wait_complete"
