"""Where an L3 hit's wait goes, on a real vLLM CPU engine with the file
backend: every stage is non-negative, and together they are the wait the
request had between its arrival and its admission, as measured around the
scheduler half's own hooks (and as the access log records it)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.engine_utils import (
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    settle_backups,
)
from tests.e2e.engine_utils import scheduler_half as sched_of
from tests.e2e.test_engine_l3 import expected_hits, l3_extra
from vllm_hicache.l3.hit_stages import WAIT_STAGES
from vllm_hicache.planner.log_format import Admit, Arrive, read_log

pytestmark = pytest.mark.engine

# What the stages may miss of the measured wait: the hooks' own code
# between the measuring points and the planner's (no I/O, no waiting), and a
# thread switch or two on a loaded machine.
SLACK_S = 0.005
SLACK_FRACTION = 0.1


class Waits:
    """Arrival and admission times of each request, around the scheduler
    half's hooks, and the stages it recorded at admission."""

    def __init__(self, sched) -> None:
        self.arrived: dict[str, float] = {}
        self.admitted: dict[str, float] = {}
        self.stages: dict[str, dict[str, float]] = {}
        arrive, admit, record = (sched.on_new_request, sched.update_state_after_alloc,
                                 sched.hit_timer.admitted)

        def on_new_request(request):
            self.arrived.setdefault(request.request_id, time.monotonic())
            arrive(request)

        def update_state_after_alloc(request, blocks, num_external_tokens):
            admit(request, blocks, num_external_tokens)
            self.admitted.setdefault(request.request_id, time.monotonic())

        def admitted(req_id, stages, *args, **kwargs):
            self.stages[req_id] = dict(stages)
            record(req_id, stages, *args, **kwargs)

        sched.on_new_request = on_new_request
        sched.update_state_after_alloc = update_state_after_alloc
        sched.hit_timer.admitted = admitted


def test_stages_of_an_l3_hit_add_up_to_its_wait(tiny_model_dir, reference, tmp_path):
    log_path = tmp_path / "access.log"
    llm = make_llm(tiny_model_dir, {**l3_extra(tmp_path / "l3"),
                                    "hicache_access_log": str(log_path)})
    try:
        prompts = prompts_with_shared_prefix()
        generate(llm, prompts)  # computed, stored to L2, backed up to L3
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)  # L1 and L2 gone
        sched = sched_of(llm)
        waits = Waits(sched)
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert cached == expected_hits(prompts)
        assert waits.stages, "no request was admitted with an L3 hit of its own"
        for req_id, stages in waits.stages.items():
            assert list(stages) == list(WAIT_STAGES)
            assert all(s >= 0 for s in stages.values()), stages
            wait_s = waits.admitted[req_id] - waits.arrived[req_id]
            gap_s = wait_s - sum(stages.values())
            assert 0 <= gap_s <= max(SLACK_S, SLACK_FRACTION * wait_s), (wait_s, stages)
    finally:
        close(llm)
    # The access log has the same stages, in microseconds, on its ADMIT records.
    records = read_log(log_path).records
    arrivals = {r.seq: r for r in records if isinstance(r, Arrive)}
    with_stages = [r for r in records if isinstance(r, Admit) and r.l3_stages_us]
    assert len(with_stages) == len(waits.stages)
    for admit in with_stages:
        assert admit.l3_tokens > 0 and set(admit.l3_stages_us) == set(WAIT_STAGES)
        logged_wait_ms = admit.t_ms - arrivals[admit.seq].t_ms
        assert sum(admit.l3_stages_us.values()) / 1000 <= logged_wait_ms + 1  # ms rounding
