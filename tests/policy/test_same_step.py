"""Same-step admission's rules (policy/same_step.py) and pieces that need
no engine (l3/same_step.py): where the option is refused, the read wait,
and the split of a step's loads into what was read in time."""

from __future__ import annotations

import pytest

from tests.conftest import make_config
from vllm_hicache.common.jobs import BlockCopy, LoadJob, SameStepLoad
from vllm_hicache.l3.same_step import check_engine, split_loads
from vllm_hicache.policy.same_step import read_wait_s


def storage(policy: str, wait_ms) -> object:
    return make_config(
        hicache_storage_backend="file", hicache_storage_prefetch_policy=policy,
        hicache_storage_backend_extra_config={"path": "/tmp/x",
                                              "same_step_read_wait_ms": wait_ms}).storage


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_waiting_policies_accept_it(policy):
    assert storage(policy, 25).same_step_read_wait_ms == 25.0


def test_best_effort_refuses_it_with_the_reason():
    with pytest.raises(ValueError, match="same_step_read_wait_ms=25.*best_effort"):
        storage("best_effort", 25)
    assert storage("best_effort", 0).same_step_read_wait_ms == 0.0  # off is fine


@pytest.mark.parametrize("bad", [-1, 1001, "fast", True])
def test_bad_values_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="same_step_read_wait_ms"):
        storage("wait_complete", bad)


def test_engines_that_cannot_use_it_refuse_it():
    cfg = storage("wait_complete", 25)
    check_engine(cfg, load_async=False, hybrid=False)  # layerwise, one group: fine
    with pytest.raises(ValueError, match="same_step_read_wait_ms.*hicache_load_mode=async"):
        check_engine(cfg, load_async=True, hybrid=False)
    with pytest.raises(ValueError, match="same_step_read_wait_ms.*KV cache groups"):
        check_engine(cfg, load_async=False, hybrid=True)
    check_engine(storage("wait_complete", 0), load_async=True, hybrid=True)  # off: anything


def test_the_read_wait_is_cut_to_the_deadline():
    assert read_wait_s(50.0, 10.0) == 0.05
    assert read_wait_s(50.0, 0.01) == 0.01
    assert read_wait_s(50.0, -1.0) == 0.0  # past its deadline: no wait at all


def job(req_id: str, op_id: int, blocks, pages, wait_s=0.1) -> SameStepLoad:
    return SameStepLoad(req_id, op_id, BlockCopy(tuple(blocks), tuple(pages)), wait_s)


def test_the_read_prefix_joins_the_request_load_and_the_rest_fails():
    l2 = LoadJob("a", BlockCopy((1, 2), (10, 11)))
    read = {5: 2, 6: 0}  # op -> pages read in time
    loads, unread = split_loads([l2], [job("a", 5, (3, 4, 5), (12, 13, 14)),
                                       job("b", 6, (7,), (15,))],
                                lambda gen, op, n, t: read[op])
    assert loads == [LoadJob("a", BlockCopy((1, 2, 3, 4), (10, 11, 12, 13)))]
    assert unread == [5, 7]


def test_a_request_without_an_l2_part_gets_its_own_load():
    loads, unread = split_loads([], [job("a", 5, (3, 4), (12, 13))], lambda *_: 2)
    assert loads == [LoadJob("a", BlockCopy((3, 4), (12, 13)))] and unread == []


def test_the_step_waits_at_most_the_longest_wait():
    """Each job's wait counts from the same start: the second gets what is left."""
    now = [0.0]
    asked = []

    def wait_read(gen, op, n, timeout_s):
        asked.append(timeout_s)
        now[0] += timeout_s  # the read never came
        return 0

    split_loads([], [job("a", 1, (1,), (1,), 0.1), job("b", 2, (2,), (2,), 0.15)],
                wait_read, clock=lambda: now[0])
    assert asked == pytest.approx([0.1, 0.05])


def test_a_confused_wait_read_cannot_overrun_the_job():
    loads, unread = split_loads([], [job("a", 1, (1, 2), (1, 2))], lambda *_: 5)
    assert loads == [LoadJob("a", BlockCopy((1, 2), (1, 2)))] and unread == []
