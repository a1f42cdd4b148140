"""Engine tests' view of a file-backend L3 store: its objects, a bounded wait
for backups to land there (``await_objects``: for engines in another
process, which ``engine_utils.settle_backups`` cannot reach), and negative
controls that rewrite objects so that they still verify (resealed with the
checksum codec, as an instance without storage_secret writes them) but hold
other KV. An engine that then hits them and still answers like recomputation
did not use the KV it loaded. ``reflag`` keeps an object's KV but reseals it under the other
state flag (models with a state group: storage/pages.py)."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from vllm_hicache.l3.canary import is_canary_key
from vllm_hicache.storage.format import HEADER_BYTES, header_key_digest, key_digest
from vllm_hicache.storage.pages import state_sealed_key
from vllm_hicache.storage.sealing import ChecksumCodec


def objects(root: str | Path) -> dict[str, Path]:
    """key -> file of every block's object under ``root`` (keys: keys.py;
    not the start-up canaries, l3/canary.py)."""
    found = {p.name.removesuffix(".hckv"): p for p in Path(root).rglob("*.hckv")}
    return {k: p for k, p in found.items() if not is_canary_key(k)}


def await_objects(root: str | Path, count: int, timeout_s: float = 120.0) -> int:
    """Poll (every 50 ms, at most ``timeout_s``) until ``root`` holds at
    least ``count`` block objects; how many it holds. A backup's objects are
    published one by one and its acknowledgement follows the last, so a
    caller then runs a short request: its steps carry the acknowledgements
    back to the scheduler. AssertionError when they do not arrive in time."""
    deadline = time.monotonic() + timeout_s
    while (found := len(objects(root))) < count:
        assert time.monotonic() < deadline, f"{found} of {count} L3 objects after {timeout_s} s"
        time.sleep(0.05)
    return found


def shard_of(key: str) -> str:
    return key.split("-")[2]


def _payload(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes()[HEADER_BYTES:], np.uint8).copy()


def _reseal(path: Path, key: str, payload: np.ndarray) -> None:
    header = np.empty(HEADER_BYTES, np.uint8)
    body = ChecksumCodec().seal(key, payload, header)
    path.write_bytes(header.tobytes() + body.tobytes())


def swap_shards(root: str | Path, a: str, b: str) -> int:
    """Swap the payloads of shard ``a``'s and ``b``'s objects of each block
    (e.g. head slices s0 and s1); the number of pairs swapped."""
    by_block: dict[tuple[str, str], dict[str, tuple[str, Path]]] = defaultdict(dict)
    for key, path in objects(root).items():
        _, digest, shard, block = key.split("-")
        by_block[(digest, block)][shard] = (key, path)
    pairs = [(s[a], s[b]) for s in by_block.values() if a in s and b in s]
    for (key_a, path_a), (key_b, path_b) in pairs:
        payload_a, payload_b = _payload(path_a), _payload(path_b)
        _reseal(path_a, key_a, payload_b)
        _reseal(path_b, key_b, payload_a)
    return len(pairs)


def shift_shard(root: str | Path, shard: str) -> int:
    """Give each of ``shard``'s objects but the last the payload of the next
    one (another block's KV: the first block's is lost, the last one's
    doubled); the number of objects rewritten. Not a rotation: attention
    sums over (K, V) pairs, so a permutation of whole blocks would change
    no answer."""
    found = sorted((k, p) for k, p in objects(root).items() if shard_of(k) == shard)
    for (key, path), (_, donor) in zip(found, found[1:]):
        _reseal(path, key, _payload(donor))
    return max(0, len(found) - 1)


def state_flag(path: Path, key: str) -> bool:
    """Whether the object (of a model with a state group) says its page's
    state is valid: the key it is sealed under (storage/pages.py)."""
    header = np.frombuffer(path.read_bytes()[:HEADER_BYTES], np.uint8)
    return header_key_digest(header) == key_digest(state_sealed_key(key, True))


def reflag(root: str | Path, keys, state_valid: bool) -> int:
    """Reseal those of ``keys``' objects that say otherwise as saying
    ``state_valid`` (same payload; they still verify); how many."""
    found = objects(root)
    flipped = 0
    for key in keys:
        path = found[key]
        if state_flag(path, key) != state_valid:
            payload = _payload(path)
            _reseal(path, state_sealed_key(key, state_valid), payload)
            header = np.frombuffer(path.read_bytes()[:HEADER_BYTES], np.uint8)
            assert ChecksumCodec().open(state_sealed_key(key, state_valid), header, payload,
                                        payload.copy())
            flipped += 1
    return flipped
