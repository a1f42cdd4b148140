"""Maps the node tier's segment into this process ahead of its reads, on a
background thread (Linux's ``MADV_POPULATE_READ``, kernel 5.14 and later).

Why: a process's first read of a tmpfs page it never touched takes a page
fault per 4 KiB. A cross-instance hit reads slots another member wrote, and
measured on the demo model (24 pages of 192 KiB), a direct load that first
touched its slots spent about 0.4 ms of its 1.3 ms in those faults, on the
forward's thread. Mapping the segment once at start moves that off the
request path.

Cost: the page tables, 8 bytes per 4 KiB page (0.2% of the tier per member),
which a member builds anyway as it reads; and one thread's time at start, in
chunks so that a stop is prompt. Nothing is allocated: the segment's blocks
exist (``posix_fallocate``). Where the call is refused (older kernels:
EINVAL) pages fault in on first read, as before. On CUDA the segment is
registered with the driver, which maps it already: not started there.
"""

from __future__ import annotations

import ctypes
import logging
import threading

from vllm_hicache import io_threads

logger = logging.getLogger(__name__)

MADV_POPULATE_READ = 22
# Per call: small enough that stop() never waits long.
CHUNK_BYTES = 16 << 20
_STOP_JOIN_S = 2.0


class MappingWarmer:
    """Populates ``num_bytes`` at ``address`` (a live, page-aligned mapping
    the caller keeps until ``stop`` returns) on a daemon thread."""

    def __init__(self, address: int, num_bytes: int) -> None:
        self._address = address
        self._num_bytes = num_bytes
        self._stop = threading.Event()
        self.warmed_bytes = 0
        self._thread = threading.Thread(target=self._run, name="hicache-node-map", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        io_threads.enter_io_thread()
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        while self.warmed_bytes < self._num_bytes and not self._stop.is_set():
            num = min(CHUNK_BYTES, self._num_bytes - self.warmed_bytes)
            # ctypes releases the GIL for the call.
            if madvise(self._address + self.warmed_bytes, num, MADV_POPULATE_READ) != 0:
                logger.debug("HiCache node tier: segment not premapped (errno %d); its "
                             "pages map on first read", ctypes.get_errno())
                return
            self.warmed_bytes += num

    def wait(self, timeout_s: float) -> bool:
        """True once the whole range is mapped (or the thread gave up)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the current chunk; the mapping may be unmapped after."""
        self._stop.set()
        self._thread.join(_STOP_JOIN_S)
        if self._thread.is_alive():  # a chunk is a few ms; never seen
            logger.warning("HiCache node tier: the segment premap thread did not stop")
