"""Joining a node tier: its directory per name and identity, creating,
opening or replacing its files (the layout in the package docstring), and
the first steps of a membership (lease, member row).

Creation, replacement and joining are serialised per tier by a flock the
kernel drops if its holder dies; a creation that dies halfway leaves a
directory without ``ready``, which the next joiner replaces. An existing
tier is used only when its settings, identity and creation match what the
joiner asks for; otherwise it is replaced when no member lives, and refused
while one does.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass

from vllm_hicache.node.errors import NodeTierError
from vllm_hicache.node.index import EVICTION_POLICIES, Index
from vllm_hicache.node.lease import Lease, live_leases, new_member_id, remove_unfinished
from vllm_hicache.node.reclaim import reclaim_dead
from vllm_hicache.node.segment import Geometry, Segment

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_READY = "ready"


def members_dir(directory: str) -> str:
    """The tier's lease files (lease.py)."""
    return os.path.join(directory, "members")


def index_path(directory: str) -> str:
    """The tier's index (index.py)."""
    return os.path.join(directory, "index.sqlite")


@dataclass(frozen=True)
class Joined:
    """A new member's handles on the tier at ``directory``."""

    directory: str
    segment: Segment
    index: Index
    lease: Lease
    member_id: str


def join_tier(name: str, identity: str, capacity_bytes: int, page_bytes: int, root: str,
              eviction: str, lock_timeout_s: float, sweep_interval_s: float) -> Joined:
    """Open (creating or replacing it when needed) the tier ``name`` of
    ``identity`` and become a member of it (NodeTier.join says the rules)."""
    check_join_args(name, identity, capacity_bytes, page_bytes, root, eviction,
                    lock_timeout_s, sweep_interval_s)
    directory = tier_directory(root, name, identity)
    digest = hashlib.sha256(identity.encode()).digest()
    # Before anything is touched: a size that holds no page changes nothing.
    geometry = Geometry.for_capacity(capacity_bytes, page_bytes)
    member_id = new_member_id()
    # Creation, replacement and the first steps of membership are
    # serialised per tier by a flock the kernel drops if its holder dies.
    lock_fd = os.open(os.path.join(root, f".{os.path.basename(directory)}.lock"),
                      os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        segment, index = _open_or_create(directory, digest, geometry, eviction, lock_timeout_s)
        try:
            lease = Lease.acquire(members_dir(directory), member_id)
            index.add_member(member_id, os.getpid())
        except BaseException:
            index.close()
            segment.close()
            raise
    finally:
        os.close(lock_fd)
    logger.info("HiCache node tier %r: joined %s as %s (%d slots of %d bytes)", name,
                directory, member_id, segment.geometry.num_slots, page_bytes)
    return Joined(directory, segment, index, lease, member_id)


def tier_directory(root: str, name: str, identity: str) -> str:
    """Where the tier of ``name`` for ``identity`` lives: tiers of different
    identities never share a directory."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return os.path.join(root, f"hicache-node-{name}-{digest}")


def check_name(name: object) -> str:
    """``name`` if it can name a tier (it becomes part of a directory name),
    else ValueError saying what is accepted."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"node tier name {name!r}: 1 to 64 letters, digits, '_', '.' or "
                         "'-', starting with a letter or digit")
    return name


def check_join_args(name: str, identity: str, capacity_bytes: int, page_bytes: int,
                    root: str, eviction: str, lock_timeout_s: float,
                    sweep_interval_s: float) -> None:
    """ValueError (NodeTierError for a missing root) naming the bad argument."""
    check_name(name)
    if not isinstance(identity, str) or not identity:
        raise ValueError("node tier identity must be a non-empty string (the key namespace "
                         "of the KV bytes, e.g. KeyNamespace.tag)")
    for what, value in (("capacity_bytes", capacity_bytes), ("page_bytes", page_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"node tier {what} must be a positive integer, got {value!r}")
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f"node tier eviction {eviction!r}: one of {', '.join(EVICTION_POLICIES)}")
    for what, seconds in (("lock_timeout_s", lock_timeout_s),
                          ("sweep_interval_s", sweep_interval_s)):
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"node tier {what} must be a positive number, got {seconds!r}")
    if not os.path.isdir(root):
        raise NodeTierError(f"node tier root {root} is not a directory (a tmpfs such as "
                            "/dev/shm is expected)")


def _differences(settings: dict[str, object], segment: Segment, digest: bytes,
                 wanted: dict[str, object]) -> list[str]:
    """How an existing tier differs from what a joiner asks for."""
    out = []
    if settings.get("identity_sha256") != digest.hex() or segment.identity_digest != digest:
        out.append("it holds another identity's pages (a tier directory name collision)")
    if settings.get("epoch") != segment.epoch.hex():
        out.append("its index and its segment come from different creations")
    for what, value in wanted.items():
        if settings.get(what) != value:
            out.append(f"{what} is {settings.get(what)!r} there, {value!r} here")
    return out


def _open_or_create(directory: str, digest: bytes, geometry: Geometry, eviction: str,
                    lock_timeout_s: float) -> tuple[Segment, Index]:
    """The tier at ``directory`` as asked for: opened as it is, or made anew
    (absent, half made, or differing with no member alive); NodeTierError
    while a live member uses a tier that differs. Called under the flock."""
    leases = members_dir(directory)
    wanted: dict[str, object] = {"capacity_bytes": geometry.capacity_bytes,
                                 "page_bytes": geometry.page_bytes, "eviction": eviction}
    if os.path.exists(os.path.join(directory, _READY)):
        opened = _open(directory, digest, wanted, lock_timeout_s)
        if isinstance(opened, tuple):
            return opened
        live = live_leases(leases)
        if live:
            raise NodeTierError(
                f"node tier at {directory} is in use by {live} live member(s) and "
                f"{opened}. Every instance sharing a node tier must configure the same "
                "size, page size and eviction policy (or use another tier name)")
        logger.warning("HiCache node tier at %s: no live member and %s: replacing it "
                       "(its pages are dropped)", directory, opened)
    if os.path.exists(directory):
        shutil.rmtree(directory)  # a replaced tier, or a creation that died halfway
    os.makedirs(leases)
    epoch = secrets.token_bytes(16)
    try:
        segment = Segment.create(os.path.join(directory, "pages"), geometry, digest, epoch)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    index = Index(index_path(directory), lock_timeout_s)
    index.create(geometry.num_slots, {
        "identity_sha256": digest.hex(), "epoch": epoch.hex(),
        "capacity_bytes": geometry.capacity_bytes, "page_bytes": geometry.page_bytes,
        "num_slots": geometry.num_slots}, eviction)
    # Written last: a directory without it is a creation that died.
    ready = os.path.join(directory, f".{_READY}")
    with open(ready, "w") as f:
        f.write(epoch.hex() + "\n")
    os.rename(ready, os.path.join(directory, _READY))
    return segment, index


def _open(directory: str, digest: bytes, wanted: dict[str, object],
          lock_timeout_s: float) -> tuple[Segment, Index] | str:
    """The existing tier, or why it cannot be used as it is."""
    try:
        segment = Segment.attach(os.path.join(directory, "pages"))
    except (OSError, NodeTierError) as e:
        return f"its segment is damaged ({e})"
    index = Index(index_path(directory), lock_timeout_s)
    try:
        settings = index.settings()
    except NodeTierError as e:
        index.close()
        segment.close()
        return f"its index is damaged ({e})"
    differs = _differences(settings, segment, digest, wanted)
    if differs:
        index.close()
        segment.close()
        return "it differs from what this process asks for: " + "; ".join(differs)
    index.use_policy(str(settings["eviction"]))
    reclaim_dead(index, members_dir(directory), None)
    remove_unfinished(members_dir(directory))  # we hold the creation lock
    return segment, index
