"""The data path on CPU tensors (tests/gpu/ runs the same scenarios on CUDA).

Copies are synchronous here, so the ordering checks degrade: a layer's
loads run at its own hook, and a step's stores finish before the next step
starts. What still holds, and is checked: the bytes (stored == computed,
loaded == stored, nothing else written), the mapping of copy failures to
load errors, failed stores, and the hook order.
"""

from __future__ import annotations

import pytest

from tests.datapath import scenarios
from tests.datapath.rig import CPU_CASES, Rig, same
from vllm_hicache.common.jobs import NO_COPY, BlockCopy, LoadJob
from vllm_hicache.host import MEM_LAYOUTS


@pytest.fixture
def rig_factory():
    rigs: list[Rig] = []

    def make(case="flash_attn_nhd", mem_layout="layer_first", io_backend="direct"):
        rigs.append(Rig(CPU_CASES[case], mem_layout, io_backend))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_roundtrip(rig_factory, case, mem_layout):
    scenarios.check_roundtrip(rig_factory(case, mem_layout))


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first"])
def test_roundtrip_kernel_interpreted(rig_factory, mem_layout, interpreted_triton):
    scenarios.check_roundtrip(rig_factory("flash_attn_nhd", mem_layout, "kernel"))


def test_layers_load_at_their_hook(rig_factory):
    scenarios.check_layers_load_at_their_hook(rig_factory())


@pytest.mark.parametrize("mem_layout", MEM_LAYOUTS)
def test_stores_then_reuse(rig_factory, mem_layout):
    scenarios.check_stores_never_race(rig_factory("flash_attn_nhd", mem_layout))


@pytest.mark.parametrize("fail_layer", [0, 2])
def test_layer_load_failure(rig_factory, fail_layer):
    scenarios.check_layer_load_failure(rig_factory(), fail_layer)


def test_transfer_refusal_is_a_load_error(rig_factory):
    scenarios.check_transfer_refusal_is_a_load_error(rig_factory())


def test_async_load_failure(rig_factory):
    scenarios.check_async_load_failure(rig_factory())


def test_store_failure(rig_factory):
    scenarios.check_store_failure(rig_factory())


def test_skipped_layer_hooks_fail_every_load(rig_factory):
    """A forward that never called the layer hooks used unloaded KV: the
    loads still land (for the cache's sake) and all of them are errors."""
    rig = rig_factory()
    kv = rig.store(scenarios.SRC, scenarios.PAGES, seed=1)
    load = LoadJob("r", BlockCopy(scenarios.DST, scenarios.PAGES))
    rig.step(loads=[load], forward=lambda: rig.forward(wait=False))
    assert rig.dp.take_load_errors() == set(scenarios.DST)
    assert same(rig.read_blocks(scenarios.DST), kv)


def test_loads_land_before_compute_on_cpu(rig_factory):
    """The GPU scenario with nothing held back: on CPU the hook is where a
    layer loads, so a forward that skips it reads poison, as on a GPU."""
    scenarios.check_loads_land_before_compute(rig_factory(), lambda stream: None)


def test_loads_added_at_the_first_layer_and_a_request_failed_midway(rig_factory):
    """A same-step read known only at the first layer's hook joins the
    step's loads there (``add_loads``); a request whose read then falls
    behind stops (``fail_request``): all its loads' blocks are load errors,
    its later layers are not copied, another request's load is untouched,
    and the step's stores are dropped."""
    rig = rig_factory()
    kv = rig.store(scenarios.SRC, scenarios.PAGES, seed=1)
    dp = rig.dp
    first = LoadJob("r", BlockCopy(scenarios.DST[:2], scenarios.PAGES[:2]))
    added = LoadJob("r", BlockCopy(scenarios.DST[2:4], scenarios.PAGES[2:4]))
    other = LoadJob("s", BlockCopy(scenarios.DST[4:], scenarios.PAGES[4:]))
    dp.before_forward(NO_COPY)
    dp.begin_step([], more_loads=True)
    dp.start_loads()
    for layer in range(rig.num_layers):
        if layer == 0:
            dp.add_loads([first, added, other])
        if layer == 1:
            dp.fail_request("r")
        dp.wait_layer(layer)
    dp.after_forward(BlockCopy(scenarios.SRC[:1], (scenarios.PAGES[5],)))
    dp.end_step()
    assert dp.take_load_errors() == set(scenarios.DST[:4])
    assert dp.take_failed_store_pages() == {scenarios.PAGES[5]}  # the store was dropped
    assert same(rig.read_blocks(scenarios.DST[4:]), kv[4:])  # "s" loaded whole
    # "r": layer 0 copied, layer 1 on not.
    assert same(rig.read_layer(0, scenarios.DST[:4]), kv[:4, 0])
    assert not same(rig.read_layer(1, scenarios.DST[:4]), kv[:4, 1])
    # A request failed before its other load joins: that one fails too.
    dp.begin_step([first], more_loads=True)
    dp.fail_request("r")
    dp.add_loads([added])
    dp.wait_layer(0)
    assert dp.take_load_errors() == set(scenarios.DST[:4])
    dp.after_forward()
    dp.end_step()
    with pytest.raises(AssertionError):  # loads join only before the first layer
        dp.begin_step([], more_loads=True)
        dp.wait_layer(0)
        dp.add_loads([other])
