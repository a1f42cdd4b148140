"""Data movement L1 <-> L2: layout descriptors of vLLM's KV tensors and the
copy backends (``direct``: torch copies; ``kernel``: Triton, CUDA only).

The public names below are loaded on first use (PEP 562): importing the
pure ``io_backends`` (which ``config.py`` does) never imports torch, and
importing this package never imports triton (``triton_copy`` is loaded by
``KernelTransfer`` on construction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hicache.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from vllm_hicache.kernels.base import KVTransfer
    from vllm_hicache.kernels.device_layout import DeviceKVLayout, describe_kv_tensor
    from vllm_hicache.kernels.direct import DirectTransfer
    from vllm_hicache.kernels.factory import kernel_io_missing, make_transfer
    from vllm_hicache.kernels.io_backends import IO_BACKENDS
    from vllm_hicache.kernels.kernel_transfer import KernelTransfer
    from vllm_hicache.kernels.plan import Run, merge_runs

# Public name -> the submodule that defines it.
_HOMES = {
    "IO_BACKENDS": "io_backends",
    "KVTransfer": "base",
    "DeviceKVLayout": "device_layout",
    "describe_kv_tensor": "device_layout",
    "DirectTransfer": "direct",
    "kernel_io_missing": "factory",
    "make_transfer": "factory",
    "KernelTransfer": "kernel_transfer",
    "Run": "plan",
    "merge_runs": "plan",
}

# Literal, so type checkers see the re-exports.
__all__ = [
    "DeviceKVLayout",
    "DirectTransfer",
    "IO_BACKENDS",
    "KVTransfer",
    "KernelTransfer",
    "Run",
    "describe_kv_tensor",
    "kernel_io_missing",
    "make_transfer",
    "merge_runs",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
