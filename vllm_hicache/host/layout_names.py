"""Names of the host (L2) pool layouts: the values ``hicache_mem_layout`` accepts.

Pure module (no torch): ``config.py`` validates the option against these
names, and ``host/__init__.py`` loads its torch-backed modules lazily so
that importing this one stays cheap. ``layout.py`` says what each layout
stores where.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class MemLayout(StrEnum):
    """A host pool layout; a str, so it compares, prints and serialises as its name."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


MEM_LAYOUTS: Final = tuple(MemLayout)

# Layouts whose rows keep the L1 tensor's native block order.
NATIVE_LAYOUTS: Final = (MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST_DIRECT)
