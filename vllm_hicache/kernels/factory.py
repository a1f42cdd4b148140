"""Builds the ``KVTransfer`` a resolved ``hicache_io_backend`` names.

Kept apart from ``base.py`` (the interface the backends implement) so that
the backends import the interface and this module imports the backends:
the arrows run one way, with no cycle.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from vllm_hicache.host.pool import HostKVPool
from vllm_hicache.kernels.base import KVTransfer
from vllm_hicache.kernels.device_layout import DeviceKVLayout
from vllm_hicache.kernels.direct import DirectTransfer
from vllm_hicache.kernels.io_backends import IO_BACKENDS, IOBackend
from vllm_hicache.kernels.kernel_transfer import KernelTransfer


def make_transfer(
    io_backend: str,
    kv_caches: Sequence[torch.Tensor],
    layouts: Sequence[DeviceKVLayout],
    pool: HostKVPool,
) -> KVTransfer:
    """Build the copy engine named by the resolved ``hicache_io_backend``.

    Chooses nothing: ``config.resolve_conflicts`` decided the backend (and
    the layout that goes with it) before the pool existed. ``kernel``
    without its prerequisites is refused, naming what is missing.
    """
    if io_backend not in IO_BACKENDS:
        raise ValueError(
            f"unknown hicache_io_backend {io_backend!r}; accepted: {', '.join(IO_BACKENDS)}"
        )
    if io_backend == IOBackend.DIRECT:
        return DirectTransfer(kv_caches, layouts, pool)
    missing = kernel_io_missing(kv_caches[0].device.type == "cuda") or (
        "" if pool.is_pinned else "a pinned host pool")
    if missing:
        raise ValueError(f"hicache_io_backend=kernel needs {missing}; resolve the "
                         "configuration with config.resolve_conflicts first")
    return KernelTransfer(kv_caches, layouts, pool)


def kernel_io_missing(device_is_cuda: bool) -> str:
    """What the kernel backend lacks on this platform ('' when nothing);
    the pinned pool, known only once allocated, is checked by the worker."""
    if not (device_is_cuda and torch.cuda.is_available()):
        return "CUDA"
    if importlib.util.find_spec("triton") is None:
        return "Triton, which is not installed"
    return ""
