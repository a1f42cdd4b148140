"""A member of the test tier that does one thing and then waits to be killed
(tests/node/helpers.Child runs it). Usage:

    python -m tests.node.child ROOT SLOTS ACTION [KEYS...]

ACTION:
    mid-write     reserve a slot, write half of KEYS[0]'s page, die
    sealed-only   fill KEYS[0]'s slot and write its seal to the segment,
                  die before the index publishes it
    in-txn        open an index write transaction, change a slot in it, wait
    pin           insert KEYS (if absent), pin them all, wait
    insert        insert KEYS, wait (without leaving)
    stop          insert KEYS, pin them, reserve a slot, wait; on SIGTERM or
                  SIGINT leave the tier (an engine's shutdown path) and exit
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tests.node.helpers import IDENTITY, NAME, PAGE_BYTES, capacity_for, page_of
from vllm_hicache.node import join
from vllm_hicache.node.segment import SlotSeal


def insert(tier, keys: list[bytes]) -> None:
    for key in keys:
        if tier.lookup([key]):
            continue
        (res,) = tier.reserve(1).slots
        tier.write(res, page_of(key))
        tier.seal(res, key)


def main() -> None:
    root, slots, action, *names = sys.argv[1:]
    keys = [n.encode() for n in names]
    tier = join(NAME, IDENTITY, capacity_for(int(slots)), PAGE_BYTES, root=root,
                sweep_interval_s=0.2)

    def ready(extra: str = "") -> None:
        print("ready", extra, flush=True)

    if action == "mid-write":
        (res,) = tier.reserve(1).slots
        tier.view(res)[:PAGE_BYTES // 2] = page_of(keys[0])[:PAGE_BYTES // 2]
        print("ready", tier.member_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sealed-only":
        (res,) = tier.reserve(1).slots
        tier.write(res, page_of(keys[0]))
        tier._segment.write_seal(res.slot, SlotSeal(res.gen, PAGE_BYTES, 0, keys[0]))
        print("ready", tier.member_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "in-txn":
        with tier._index.write() as db:
            db.execute("UPDATE slots SET state = 1, owner = 'nobody', gen = gen + 1 "
                       "WHERE slot = 0")
            ready(tier.member_id)
            time.sleep(600)
    elif action == "pin":
        insert(tier, keys)
        assert tier.pin(keys) == len(keys)
        ready(tier.member_id)
        time.sleep(600)
    elif action == "stop":
        insert(tier, keys)
        assert tier.pin(keys) == len(keys)
        assert len(tier.reserve(1).slots) == 1

        def stop(signum, frame) -> None:
            tier.leave()
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        ready(tier.member_id)
        time.sleep(600)
    elif action == "insert":
        insert(tier, keys)
        ready(tier.member_id)
        time.sleep(600)
    else:
        raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    main()
