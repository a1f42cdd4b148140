"""Data movement L1 <-> L2: layout descriptors of vLLM's KV tensors and the
copy backends (``direct``: torch copies; ``kernel``: Triton, CUDA only).

Importing this package never imports triton; ``triton_copy`` is loaded by
``KernelTransfer`` on construction.
"""

from vllm_hicache.kernels.base import IO_BACKENDS, KVTransfer, kernel_io_missing, make_transfer
from vllm_hicache.kernels.device_layout import DeviceKVLayout, describe_kv_tensor
from vllm_hicache.kernels.direct import DirectTransfer
from vllm_hicache.kernels.kernel_transfer import KernelTransfer
from vllm_hicache.kernels.plan import Run, merge_runs

__all__ = [
    "IO_BACKENDS",
    "DeviceKVLayout",
    "DirectTransfer",
    "KVTransfer",
    "KernelTransfer",
    "Run",
    "describe_kv_tensor",
    "kernel_io_missing",
    "make_transfer",
    "merge_runs",
]
