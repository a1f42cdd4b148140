"""Helpers for ``Buffers``, the list of 1-D contiguous uint8 arrays an object
is read into and written from (storage/base.py): their size, their address
(for engines that take pointers), and copies between them and one flat array
holding the object (a staging slot, a reply)."""

from __future__ import annotations

import numpy as np

from vllm_hicache.storage.base import Buffers


def total_bytes(buffers: Buffers) -> int:
    return sum([b.nbytes for b in buffers])


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def gather(source: Buffers, flat: np.ndarray) -> int:
    """Copy ``source`` concatenated into the head of ``flat``; bytes copied."""
    offset = 0
    for buf in source:
        n = buf.nbytes
        flat[offset:offset + n] = buf.reshape(-1).view(np.uint8)
        offset += n
    return offset


def scatter(flat: np.ndarray, target: Buffers) -> None:
    """Copy the head of ``flat`` into ``target``'s buffers, in order."""
    offset = 0
    for buf in target:
        n = buf.nbytes
        buf.reshape(-1).view(np.uint8)[:] = flat[offset:offset + n]
        offset += n
