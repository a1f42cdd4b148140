"""Names of the L1 <-> L2 copy backends: the values ``hicache_io_backend`` accepts.

Pure module (no torch): ``config.py`` validates the option against these
names, and ``kernels/__init__.py`` loads its torch-backed modules lazily so
that importing this one stays cheap. ``factory.make_transfer`` builds the
backend a name stands for.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class IOBackend(StrEnum):
    """A copy backend; a str, so it compares, prints and serialises as its name."""

    KERNEL = "kernel"  # Triton copies (CUDA only)
    DIRECT = "direct"  # torch copies


IO_BACKENDS: Final = tuple(IOBackend)
