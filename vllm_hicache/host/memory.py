"""Host memory: will the pool fit, and pinning it for DMA.

Invariant: the pool is checked against ``MemAvailable`` minus a reserve
*before* anything is allocated, so an oversized ``hicache_size`` /
``hicache_ratio`` fails at start-up with the numbers, not later in the OOM
killer. The reserve, ``max(2 GiB, 5% of MemTotal)``, leaves room for vLLM's
own processes, tokenizer workers and the page cache.

Pinning registers an already touched buffer with ``cudaHostRegister``
instead of allocating through torch's pinned allocator, which rounds large
requests up (to a power of two on some versions): a 70 GB pool must not
cost 128 GB. Pinning is a bandwidth optimisation for the ``direct`` backend
but a requirement for the ``kernel`` backend, whose kernels dereference host
addresses through unified virtual addressing (UVA).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30
MIN_RESERVE_BYTES = 2 * GiB
RESERVE_FRACTION = 0.05
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every
# device, and mapped into the device address space for UVA kernels.
_REGISTER_FLAGS = 0x01 | 0x02


class MemInfo(NamedTuple):
    total_bytes: int
    available_bytes: int


def read_meminfo(path: str | Path = "/proc/meminfo") -> MemInfo:
    """MemTotal and MemAvailable, in bytes."""
    fields: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            # /proc/meminfo reports kB (KiB, despite the name).
            fields[name] = int(parts[0]) * 1024
    try:
        return MemInfo(fields["MemTotal"], fields["MemAvailable"])
    except KeyError as err:
        raise RuntimeError(f"{path} lacks {err.args[0]}; cannot size the host pool") from None


def reserve_bytes(total_bytes: int) -> int:
    """Host memory the pool must leave free."""
    return max(MIN_RESERVE_BYTES, int(total_bytes * RESERVE_FRACTION))


def check_fits(
    host_bytes: int,
    meminfo: MemInfo | None = None,
    reserve: int | None = None,
) -> None:
    """Raise ValueError unless ``host_bytes`` fits in available memory minus the reserve."""
    info = meminfo if meminfo is not None else read_meminfo()
    keep = reserve if reserve is not None else reserve_bytes(info.total_bytes)
    usable = info.available_bytes - keep
    if host_bytes > usable:
        raise ValueError(
            f"host KV pool of {host_bytes} bytes ({host_bytes / GiB:.2f} GiB) does not "
            f"fit: MemAvailable is {info.available_bytes} bytes "
            f"({info.available_bytes / GiB:.2f} GiB) and {keep} bytes "
            f"({keep / GiB:.2f} GiB) are kept in reserve, leaving {max(usable, 0)} "
            "bytes; lower hicache_size or hicache_ratio"
        )


def pin_buffer(buffer: torch.Tensor) -> bool:
    """Register ``buffer`` as pinned; False (with a warning) if that fails."""
    assert buffer.device.type == "cpu" and buffer.is_contiguous()
    nbytes = buffer.numel() * buffer.element_size()
    return pin_range(buffer.data_ptr(), nbytes, "the host KV pool")


def pin_range(address: int, nbytes: int, what: str) -> bool:
    """Register ``nbytes`` of host memory at ``address`` as pinned (and
    mapped for UVA); False (with a warning naming ``what``) if that fails."""
    if not torch.cuda.is_available():
        logger.warning("pin_memory=True but no CUDA device is visible; %s stays pageable",
                       what)
        return False
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_FLAGS)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister of %d bytes of %s failed (%s); copies will use pageable "
            "memory and the kernel I/O backend is unavailable", nbytes, what, err,
        )
        return False
    return True


def unpin_address(address: int) -> None:
    """Undo ``pin_buffer`` for the buffer starting at ``address``."""
    torch.cuda.cudart().cudaHostUnregister(address)
