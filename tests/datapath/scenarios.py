"""Data-path scenarios shared by the CPU tests (tests/datapath/) and the GPU
tests (tests/gpu/). Each takes a ``Rig``; ``delay(stream)`` (GPU only) queues
a spin of tens of milliseconds on ``stream`` (None: the compute stream), so
that a missing wait shows up as wrong bytes rather than as luck.

Block and page ids mix runs and singles; pages include the first and last.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.datapath.rig import FailingTransfer, Rig, same
from vllm_hicache.common.jobs import BlockCopy, LoadJob

Delay = Callable[[object], None]

SRC = (0, 1, 2, 9, 10, 23)
PAGES = (3, 4, 5, 28, 0, 17)
DST = (12, 13, 14, 6, 20, 7)
ASYNC_DST = (15, 16, 17, 8, 21, 22)


def _others(rig: Rig, blocks) -> list[int]:
    return [b for b in range(rig.num_blocks) if b not in blocks]


# --- bytes -----------------------------------------------------------------------


def check_roundtrip(rig: Rig) -> None:
    """A store after the forward holds exactly the forward's KV; a layerwise
    load puts exactly those bytes in front of every layer's attention, and an
    async load into other blocks too; nothing else in L1 changes."""
    kv = rig.store(SRC, PAGES, seed=1)
    assert same(rig.pages(PAGES), kv), "stored pages differ from the forward's KV"

    rig.poison(DST)
    others = _others(rig, DST)
    before = rig.read_blocks(others).clone()
    snapshots = rig.step(loads=[LoadJob("r", BlockCopy(DST, PAGES))],
                         forward=lambda: rig.forward(read=DST))
    rig.synchronize()
    assert not rig.dp.take_load_errors()
    for layer, seen in enumerate(snapshots):
        assert same(seen, kv[:, layer]), f"layer {layer} attended to other bytes"
    assert same(rig.read_blocks(DST), kv)
    assert same(rig.read_blocks(others), before), "a load wrote outside its blocks"

    rig.step(async_loads=[LoadJob("a", BlockCopy(ASYNC_DST, PAGES))])
    rig.poll_until({"a"})
    assert not rig.dp.take_load_errors()
    assert same(rig.read_blocks(ASYNC_DST), kv)


# --- ordering --------------------------------------------------------------------


def check_loads_land_before_compute(rig: Rig, delay: Delay) -> None:
    """GPU. Scenario: 1. pages hold KV; 2. the destination blocks are
    poisoned; 3. the transfer stream is held back, then a step loads the
    pages layer by layer while the forward reads each layer. Every layer must
    read the loaded bytes, never the poison. Control: the same forward
    without the layer hooks reads poison, so the hold-back is real."""
    kv = rig.store(SRC, PAGES, seed=1)
    load = LoadJob("r", BlockCopy(DST, PAGES))

    rig.poison(DST)
    delay(rig.dp.stream)
    snapshots = rig.step(loads=[load], forward=lambda: rig.forward(read=DST))
    rig.synchronize()
    assert not rig.dp.take_load_errors()
    for layer, seen in enumerate(snapshots):
        assert not rig.is_poison(seen), f"layer {layer} computed before its load landed"
        assert same(seen, kv[:, layer]), f"layer {layer} attended to other bytes"

    rig.poison(DST)
    delay(rig.dp.stream)
    snapshots = rig.step(loads=[load], forward=lambda: rig.forward(read=DST, wait=False))
    rig.synchronize()
    assert rig.is_poison(snapshots[0]), "control: the held-back load landed anyway"
    # Skipped hooks: every load of the step is recomputed.
    assert rig.dp.take_load_errors() == set(DST)


def check_layers_load_at_their_hook(rig: Rig) -> None:
    """CPU (copies are synchronous): layer i is loaded by its own hook, not
    before; layers after it still hold what they held."""
    kv = rig.store(SRC, PAGES, seed=1)
    rig.poison(DST)
    rig.dp.before_forward()
    rig.dp.begin_step([LoadJob("r", BlockCopy(DST, PAGES))])
    rig.dp.start_loads()
    for layer in range(rig.num_layers):
        assert rig.is_poison(rig.read_layer(layer, DST)), f"layer {layer} loaded early"
        rig.dp.wait_layer(layer)
        assert same(rig.read_layer(layer, DST), kv[:, layer])
    rig.dp.after_forward()
    rig.dp.end_step()
    assert not rig.dp.take_load_errors()


# Step N stores X (the forward just wrote them) into P; step N+1 reuses X:
# REUSED_BY_LOAD gets a hit loaded from Q, REUSED_BY_FORWARD new KV.
X = (4, 5, 6, 7)
P = (10, 11, 12, 13)
REUSED_BY_LOAD, Q = (4, 5), (20, 21)
REUSED_BY_FORWARD = (6, 7)
WRITE_BACK_PAGES = (14, 15)


def check_stores_never_race(rig: Rig, delay: Delay | None = None) -> None:
    """Scenario: 1. pages Q hold KV_Q; 2. step N's forward (held back on
    GPU) writes KV_N into blocks X, stored into pages P after it, with the
    transfer stream held back; 3. step N+1 loads Q into two of those blocks
    and its forward writes KV_N1 into the other two; 4. step N+2 writes the
    latter back (transfer held back again) before its forward overwrites
    them. P must hold KV_N (the store saw the forward's KV, and ran before
    the next step's loads and writes), the reused blocks what step N+1 put
    there, the write-back pages KV_N1."""
    hold = delay if delay is not None else (lambda stream: None)
    kv_q = rig.store(REUSED_BY_LOAD, Q, seed=2)
    kv_n = rig.random_kv(len(X), seed=3)
    kv_n1 = rig.random_kv(len(REUSED_BY_FORWARD), seed=4)
    kv_n2 = rig.random_kv(len(REUSED_BY_FORWARD), seed=5)

    def forward_n():
        hold(None)  # a slow forward: the store must wait for it
        rig.forward(write=(X, kv_n))
        hold(rig.dp.stream)  # a slow store: the next step must wait for it
        return []

    rig.step(stores=BlockCopy(X, P), forward=forward_n)
    snapshots = rig.step(
        loads=[LoadJob("hit", BlockCopy(REUSED_BY_LOAD, Q))],
        forward=lambda: rig.forward(read=REUSED_BY_LOAD, write=(REUSED_BY_FORWARD, kv_n1)))
    hold(rig.dp.stream)
    rig.step(write_back=BlockCopy(REUSED_BY_FORWARD, WRITE_BACK_PAGES),
             forward=lambda: rig.forward(write=(REUSED_BY_FORWARD, kv_n2)))
    rig.synchronize()

    assert not rig.dp.take_load_errors() and not rig.dp.take_failed_store_pages()
    assert same(rig.pages(P), kv_n), "a store raced the forward before or after it"
    assert same(rig.read_blocks(REUSED_BY_LOAD), kv_q)
    assert all(same(seen, kv_q[:, layer]) for layer, seen in enumerate(snapshots))
    assert same(rig.pages(WRITE_BACK_PAGES), kv_n1), "a write-back raced the forward"
    assert same(rig.read_blocks(REUSED_BY_FORWARD), kv_n2)


def check_race_control(rig: Rig, delay: Delay) -> None:
    """GPU control for ``check_stores_never_race``: without
    ``before_forward`` (the compute stream does not wait for the stores), a
    forward overwriting a just-stored block wins the race against a
    held-back store. Shows the hold-back makes the hazard real."""
    kv_n = rig.random_kv(len(X), seed=3)
    kv_n1 = rig.random_kv(len(REUSED_BY_FORWARD), seed=4)

    def forward_n():
        rig.forward(write=(X, kv_n))
        delay(rig.dp.stream)
        return []

    rig.step(stores=BlockCopy(X, P), forward=forward_n)
    dp = rig.dp
    dp.begin_step([])  # no before_forward
    dp.start_loads()
    rig.forward(write=(REUSED_BY_FORWARD, kv_n1))
    dp.after_forward()
    dp.end_step()
    rig.synchronize()
    assert same(rig.pages(P[2:]), kv_n1), "control: the held-back store was not overtaken"


# --- failures ----------------------------------------------------------------------

GOOD = LoadJob("good", BlockCopy((12, 13, 14), (3, 4, 5)))
BAD = LoadJob("bad", BlockCopy((20, 21, 22), (28, 0, 17)))
BAD_PAGE = 0
NEW_BLOCKS, NEW_PAGES = (1, 2), (26, 27)


def _good_kv(kv: torch.Tensor) -> torch.Tensor:
    return kv[[PAGES.index(p) for p in GOOD.copy.page_ids]]


def check_layer_load_failure(rig: Rig, fail_layer: int) -> None:
    """A layerwise copy that raises on ``fail_layer`` fails exactly its job's
    blocks: never crashes, never copied again on later layers, every layer
    still released to the compute stream, the other job loaded, and the
    step's stores dropped (they were computed over missing KV)."""
    kv = rig.store(SRC, PAGES, seed=1)
    wrapper = FailingTransfer(rig.dp.transfer, lambda op, layer, pages:
                              op == "load_layer" and layer == fail_layer and BAD_PAGE in pages)
    rig.dp.transfer = wrapper
    snapshots = rig.step(loads=[GOOD, BAD], stores=BlockCopy(NEW_BLOCKS, NEW_PAGES),
                         forward=lambda: rig.forward(read=GOOD.copy.block_ids))
    rig.synchronize()

    assert rig.dp.take_load_errors() == set(BAD.copy.block_ids)
    assert same(rig.read_blocks(GOOD.copy.block_ids), _good_kv(kv))
    assert all(same(seen, _good_kv(kv)[:, layer]) for layer, seen in enumerate(snapshots))
    bad_layers = [layer for op, layer, pages in wrapper.calls if pages == BAD.copy.page_ids]
    assert bad_layers == list(range(fail_layer + 1))
    assert rig.dp.take_failed_store_pages() == set(NEW_PAGES)
    assert not [call for call in wrapper.calls if call[0] == "store"]
    if rig.dp.stream is not None:
        assert all(rig.dp.layer_event(i) is not None for i in range(rig.num_layers))


def check_transfer_refusal_is_a_load_error(rig: Rig) -> None:
    """The copy engine itself raises (a page id past the pool): load errors
    for exactly that job, the other loads fine."""
    kv = rig.store(SRC, PAGES, seed=1)
    broken = LoadJob("broken", BlockCopy((8, 9), (1, rig.pool.num_pages)))
    rig.step(loads=[GOOD, broken])
    rig.synchronize()
    assert rig.dp.take_load_errors() == {8, 9}
    assert same(rig.read_blocks(GOOD.copy.block_ids), _good_kv(kv))


def check_async_load_failure(rig: Rig) -> None:
    """A failed async load is still reported finished, with exactly its
    blocks failed; the other one lands."""
    kv = rig.store(SRC, PAGES, seed=1)
    rig.dp.transfer = FailingTransfer(rig.dp.transfer, lambda op, layer, pages:
                                      op == "load" and BAD_PAGE in pages)
    rig.step(async_loads=[GOOD, BAD])
    rig.poll_until({"good", "bad"})
    assert rig.dp.take_load_errors() == set(BAD.copy.block_ids)
    assert same(rig.read_blocks(GOOD.copy.block_ids), _good_kv(kv))
    assert rig.dp.async_loads.num_inflight == 0


def check_store_failure(rig: Rig) -> None:
    """A store that raises reports its pages once; loads of them fail
    without copying until something rewrites them."""
    rig.store(SRC, PAGES, seed=1)
    fail = {"on": True}
    wrapper = FailingTransfer(rig.dp.transfer, lambda op, layer, pages:
                              fail["on"] and op == "store" and NEW_PAGES[0] in pages)
    rig.dp.transfer = wrapper
    rig.step(stores=BlockCopy(NEW_BLOCKS, NEW_PAGES))
    assert rig.dp.take_failed_store_pages() == set(NEW_PAGES)
    assert rig.dp.take_failed_store_pages() == set()
    assert rig.dp.unreadable([3, *NEW_PAGES]) == set(NEW_PAGES)

    reader = LoadJob("reader", BlockCopy((15, 16), (3, NEW_PAGES[1])))
    waiter = LoadJob("waiter", BlockCopy((17,), (NEW_PAGES[0],)))
    rig.step(loads=[reader, GOOD], async_loads=[waiter])
    rig.poll_until({"waiter"})
    assert rig.dp.take_load_errors() == {15, 16, 17}
    assert not [c for c in wrapper.calls if c[0] != "store" and set(c[2]) & set(NEW_PAGES)]

    fail["on"] = False
    kv = rig.store((11,), (NEW_PAGES[1],), seed=6)  # a later store succeeds
    rig.dp.rewritten([NEW_PAGES[0]])  # an L3 read rewrites the other
    assert rig.dp.unreadable(NEW_PAGES) == set()
    rig.step(loads=[LoadJob("again", BlockCopy((18,), (NEW_PAGES[1],)))])
    rig.synchronize()
    assert not rig.dp.take_load_errors()
    assert same(rig.read_blocks((18,)), kv)
