"""The node tier: one host-memory KV page pool shared by every vLLM instance
on a machine, with no service to deploy (docs/design.md, "The node tier").

Layout, all in one tmpfs directory ``<root>/hicache-node-<name>-<digest>``
(``root`` is /dev/shm; ``digest`` is of the identity, the key namespace that
decides what the KV bytes mean, so instances that differ in model, dtype,
layout, parallel shape or secret never share a tier):

    pages          the segment: fixed-size page slots, each with a seal
                   header (segment.py), mapped shared by every member
    index.sqlite   the cross-process index, SQLite in WAL mode (index.py):
                   slot states, keys, pins, members and their counters
    members/<id>   one lease file per member, flock-ed for its lifetime
                   (lease.py)
    ready          written last by the creator

Invariants, and what keeps them through a SIGKILL at any point:
- A reader gets a key's bytes or a miss, never other bytes: pages are
  published by the index only after their seal (generation, length,
  checksum, key) is in the segment; a writer unseals a slot before changing
  any byte of it; a reader checks the seal before and after copying. Where
  the CPU orders stores and loads as x86-64 does, that is all a reader
  needs (no pin, and a direct load may remember where it found a page);
  elsewhere a reader also pins the slot, and eviction never takes a pinned
  one.
- No member can block another beyond its own short transaction: the only
  locks are SQLite's fcntl locks and flocks, which the kernel drops when
  their holder dies; a transaction cut short is rolled back.
- Every slot is FREE, RESERVED by a member, or SEALED: free + reserved +
  sealed = the tier's slots, always (capacity is never lost).
- What a dead member held (pins, reservations) is reclaimed by the next
  survivor that sweeps: each member's background sweep every
  ``sweep_interval_s``, and any reservation that comes back short. A member
  is dead exactly when its lease lock can be taken.
- A restarted instance joins the same directory and finds every sealed page.

One size per machine: the first member sizes the tier; a joiner asking for
another size gets an error while any member lives (docs say why).
"""

from vllm_hicache.node.errors import NodeTierError
from vllm_hicache.node.index import Found
from vllm_hicache.node.membership import check_name, tier_directory
from vllm_hicache.node.segment import KEY_MAX_BYTES
from vllm_hicache.node.tier import (
    DEFAULT_ROOT,
    MemberStats,
    NodeTier,
    NodeTierStats,
    Reservation,
    Reserved,
)

join = NodeTier.join

__all__ = ["DEFAULT_ROOT", "KEY_MAX_BYTES", "Found", "MemberStats", "NodeTier", "NodeTierError",
           "NodeTierStats", "Reservation", "Reserved", "check_name", "join", "tier_directory"]
