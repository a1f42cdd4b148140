"""StreamedLoads (l3/same_step.py) on its own: what each layer's copy and
the step's stores are told, from scripted reads and a fake clock."""

from __future__ import annotations

from vllm_hicache.common.jobs import BlockCopy, LoadJob, SameStepLoad
from vllm_hicache.l3.same_step import LayerGate, StreamedLoads


class Reads:
    """Scripted reads: ``layers[op][layer]`` pages delivered, ``verified[op]``
    pages checked; each wait advances the clock by ``cost_s`` (capped at its
    timeout) and is recorded with the timeout it was given."""

    def __init__(self, layers: dict[int, list[int]], verified: dict[int, int],
                 cost_s: float = 0.0) -> None:
        self.layers, self.verified, self.cost_s = layers, verified, cost_s
        self.now = 0.0
        self.waits: list[tuple[str, int, float]] = []

    def clock(self) -> float:
        return self.now

    def wait_layer(self, generation, op_id, layer, num_pages, timeout_s) -> int:
        self.waits.append(("layer", op_id, timeout_s))
        self.now += min(self.cost_s, timeout_s)
        return min(num_pages, self.layers[op_id][layer])

    def wait_read(self, generation, op_id, num_pages, timeout_s) -> int:
        self.waits.append(("read", op_id, timeout_s))
        self.now += min(self.cost_s, timeout_s)
        return min(num_pages, self.verified[op_id])


def load(req_id: str, op_id: int, blocks: list[int], wait_s: float = 1.0) -> SameStepLoad:
    return SameStepLoad(req_id, op_id, BlockCopy(blocks, [100 + b for b in blocks]), wait_s)


def streamed(reads: Reads, *loads: SameStepLoad) -> StreamedLoads:
    return StreamedLoads(loads, reads.wait_layer, reads.wait_read, reads.clock)


def test_a_whole_read_copies_every_page_and_fails_nothing():
    reads = Reads({1: [3, 3]}, {1: 3})
    s = streamed(reads, load("a", 1, [7, 8, 9]))
    assert s.before_layer(0) == LayerGate([LoadJob("a", BlockCopy([7, 8, 9], [107, 108, 109]))],
                                          [], [])
    assert s.before_layer(1) == LayerGate([], [], [])
    assert s.finish() == []


def test_the_first_layer_fixes_the_pages_copied():
    """A read short at layer 0 (a missing object) copies its prefix; the
    blocks after it are load errors at once."""
    reads = Reads({1: [1, 1], 2: [0, 0]}, {1: 1, 2: 0})
    s = streamed(reads, load("a", 1, [7, 8, 9]), load("b", 2, [4]))
    gate = s.before_layer(0)
    assert gate.loads == [LoadJob("a", BlockCopy([7], [107]))]
    assert gate.failed_blocks == [8, 9, 4]
    assert s.before_layer(1) == LayerGate([], [], [])
    assert s.finish() == []
    # "b" copied nothing: no wait for it after layer 0.
    assert [w[:2] for w in reads.waits] == [("layer", 1), ("layer", 2), ("layer", 1), ("read", 1)]


def test_a_later_layer_short_fails_the_request_once():
    reads = Reads({1: [2, 1, 1]}, {1: 1})
    s = streamed(reads, load("a", 1, [7, 8]))
    s.before_layer(0)
    assert s.before_layer(1) == LayerGate([], ["a"], [])
    assert s.before_layer(2) == LayerGate([], [], [])  # failed already: no wait, no repeat
    assert s.finish() == []  # its blocks are the data path's load errors already
    assert len(reads.waits) == 2


def test_pages_copied_but_not_verified_fail_from_the_first():
    reads = Reads({1: [3, 3]}, {1: 1})
    s = streamed(reads, load("a", 1, [7, 8, 9]))
    s.before_layer(0)
    s.before_layer(1)
    assert s.finish() == [8, 9]


def test_no_layer_hook_means_nothing_was_copied():
    """A forward that reached no layer hook: every same-step block fails."""
    s = streamed(Reads({}, {}), load("a", 1, [7, 8]), load("b", 2, [4]))
    assert s.finish() == [7, 8, 4]


def test_the_waits_share_one_budget():
    """Each wait gets what the earlier ones left of ``wait_s``: the forward
    is held at most ``wait_s`` in all, however many layers wait."""
    reads = Reads({1: [2, 2, 2]}, {1: 2}, cost_s=0.4)
    s = streamed(reads, load("a", 1, [7, 8], wait_s=1.0))
    for layer in range(3):
        s.before_layer(layer)
    s.finish()
    timeouts = [round(w[2], 6) for w in reads.waits]
    assert timeouts == [1.0, 0.6, 0.2, 0.0]
    assert abs(s.blocked_s - 1.0) < 1e-9
