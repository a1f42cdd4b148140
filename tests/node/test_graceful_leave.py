"""A member stopped gracefully (SIGTERM or SIGINT, whose handler runs the
shutdown path: ``NodeTier.leave``) is out of the tier the moment it exits:
no row, no pin, no reservation, no lease file, its pages evictable, with no
survivor's sweep involved. A member killed with SIGKILL instead keeps all
that until a sweep (tests/node/test_faults.py)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.node.helpers import Child
from tests.node.test_faults import make


def held(tier, member: str) -> tuple[bool, int, int]:
    """(a member row, pinned slots, reserved slots) of ``member``."""
    stats = tier.stats()
    return member in stats.members, stats.pinned_slots, stats.reserved_slots


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_member_leaves_at_once_without_a_sweep(node_root, signum):
    # A sweep interval of an hour: nothing here is reclaimed by a sweep.
    with make(node_root, slots=3, sweep_interval_s=3600.0) as tier:
        child = Child(node_root, 3, "stop", "a", "b")
        member = child.wait_ready()
        assert held(tier, member) == (True, 2, 1)
        child.proc.send_signal(signum)
        assert child.proc.wait(30) == 0, child.stderr()
        assert held(tier, member) == (False, 0, 0)
        assert not os.path.exists(os.path.join(tier.directory, "members", member))
        # Every slot can be had without coming up short (which would sweep):
        # the two pages it pinned are evicted, its reservation was freed.
        got = tier.reserve(3)
        assert len(got.slots) == 3 and sorted(got.evicted_keys) == [b"a", b"b"]
        assert tier.check_integrity() == []


def test_a_killed_member_keeps_its_pins_until_a_sweep(node_root):
    with make(node_root, slots=3, sweep_interval_s=3600.0) as tier:
        child = Child(node_root, 3, "stop", "a", "b")
        member = child.wait_ready()
        child.kill()
        assert held(tier, member) == (True, 2, 1)  # until someone sweeps
        assert tier.sweep() == [member]
        assert held(tier, member) == (False, 0, 0)
