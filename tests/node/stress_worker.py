"""One member of the stress test (test_stress.py): random inserts, prefix
reads, reads in place (a direct load's protocol: unpinned on x86-64),
lookups, pins and aborted reservations over a small key space, until
killed. Every page it reads must be exactly ``page_of(key)``; anything else
ends it with exit status 3 and the key on stderr.

    python -m tests.node.stress_worker ROOT SLOTS SEED
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np

from tests.node.helpers import IDENTITY, NAME, PAGE_BYTES, capacity_for, page_of
from vllm_hicache.node import join

CHAINS = 8
CHAIN_LENGTH = 6
TORN = 3


def chain(c: int) -> list[bytes]:
    return [f"c{c}-{i}".encode() for i in range(CHAIN_LENGTH)]


def insert(tier, rng: random.Random, keys: list[bytes]) -> None:
    present = tier.lookup(keys)
    got = tier.reserve(len(keys) - present)
    for res, key in zip(got.slots, keys[present:]):
        page = page_of(key)
        if rng.random() < 0.5:
            tier.write(res, page)
        else:  # in place, in two halves, as a copy engine would
            view = tier.view(res)
            view[:PAGE_BYTES // 2] = page[:PAGE_BYTES // 2]
            if rng.random() < 0.3:
                time.sleep(0.001)  # a slow fill: readers in place may see half of it
            view[PAGE_BYTES // 2:] = page[PAGE_BYTES // 2:]
            view.release()
        tier.seal(res, key)


def read(tier, rng: random.Random, keys: list[bytes]) -> None:
    outs = [np.zeros(PAGE_BYTES, np.uint8) for _ in keys]
    n = tier.read_prefix(keys, outs, verify_checksum=rng.random() < 0.5)
    for key, out in zip(keys[:n], outs):
        if out.tobytes() != page_of(key):
            print(f"torn or foreign page read for key {key!r}", file=sys.stderr, flush=True)
            os._exit(TORN)


def read_in_place(tier, rng: random.Random, keys: list[bytes]) -> None:
    """A direct load's protocol (l3/node_loads.py): hold, check the seals,
    copy from the mapping, check again; pinless where this CPU allows."""
    pages = tier.hold_pages(keys)
    mapping, g = tier.mapping(), tier.geometry  # the tier's own view: not released here
    copies = []
    for page in pages[:tier.seals_held(pages)]:
        start = g.data_offset + page.slot * g.slot_stride
        first = bytes(mapping[start:start + PAGE_BYTES // 2])
        if rng.random() < 0.3:
            time.sleep(0.001)  # a slow copy: a wider window for a refill
        copies.append(first + bytes(mapping[start + PAGE_BYTES // 2:start + PAGE_BYTES]))
    held = tier.seals_held(pages[:len(copies)])
    for page, copy in zip(pages[:held], copies):
        if copy != page_of(page.key):
            print(f"torn or foreign page read in place for key {page.key!r}",
                  file=sys.stderr, flush=True)
            os._exit(TORN)
    tier.release_pages(pages, hits=held, misses=len(keys) - held)


def main() -> None:
    root, slots, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    tier = join(NAME, IDENTITY, capacity_for(slots), PAGE_BYTES, root=root,
                sweep_interval_s=0.2)
    print("ready", tier.member_id, flush=True)
    pinned: list[list[bytes]] = []
    while True:
        keys = chain(rng.randrange(CHAINS))[:rng.randint(1, CHAIN_LENGTH)]
        op = rng.random()
        if op < 0.35:
            insert(tier, rng, keys)
        elif op < 0.55:
            read(tier, rng, keys)
        elif op < 0.7:
            read_in_place(tier, rng, keys)
        elif op < 0.8:
            tier.lookup(keys)
        elif op < 0.9:
            n = tier.pin(keys)
            if n:
                pinned.append(keys[:n])
        elif op < 0.97 and pinned:
            tier.unpin(pinned.pop(rng.randrange(len(pinned))))
        else:
            for res in tier.reserve(rng.randint(1, 2)).slots:
                tier.abort(res)


if __name__ == "__main__":
    main()
