"""Names of the host (L2) pool layouts: the values ``hicache_mem_layout`` accepts.

Pure module (no torch): ``config.py`` validates the option against these
names, and ``host/__init__.py`` loads its torch-backed modules lazily so
that importing this one stays cheap. ``layout.py`` says what each layout
stores where.
"""

from __future__ import annotations

from typing import Final

MEM_LAYOUTS: Final = ("layer_first", "page_first", "page_first_direct")

# Layouts whose rows keep the L1 tensor's native block order.
NATIVE_LAYOUTS: Final = ("layer_first", "page_first_direct")
