"""Files named by ``@/path`` in an option (a secret, a key, a config file).

Invariant: such a file is read only if it is a regular file of at most
``MAX_OPTION_FILE_BYTES``, checked on the open descriptor, so a device
(``/dev/zero``), a FIFO or a wrong, large file fails at once with an error
naming the path and the limit, never hangs or fills memory, and never shows
the content. Pure leaf module: the storage options, the storage secret and the
configuration all read files through it.
"""

from __future__ import annotations

import os
import stat

# Secrets, keys and configuration files are small; the bound keeps a wrong
# file (a disk image, /dev/zero behind a link) from filling memory.
MAX_OPTION_FILE_BYTES = 64 * 1024


def read_option_file(path: str, max_bytes: int = MAX_OPTION_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``.

    Opened non-blocking, so a FIFO is refused instead of waiting for a
    writer; checked with fstat on the open descriptor, so what is checked is
    what is read. Errors name the path and the problem, never the content.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ValueError(f"cannot read the file {path!r}: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"cannot read the file {path!r}: not a regular file")
        too_big = ValueError(f"cannot read the file {path!r}: larger than the limit of "
                             f"{max_bytes} bytes for a file named by @")
        if info.st_size > max_bytes:
            raise too_big
        chunks: list[bytes] = []
        left = max_bytes + 1  # one more byte tells a file that grew since fstat
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise too_big
        return b"".join(chunks)
    except OSError as err:
        raise ValueError(f"cannot read the file {path!r}: {err.strerror}") from None
    finally:
        os.close(fd)
