"""How the admin API switches the L3 backend (admin/storage_control.py).

- ``admin_storage_switch`` (config key): ``live`` (the default) switches
  between two engine steps while requests run; ``idle`` keeps SGLang's rule:
  an attach or detach is refused (409) unless no request is running or
  waiting, and a different backend needs a detach first.
- ``pending_backups`` (per call, PUT and DELETE bodies): what becomes of the
  backups the old backend has not written yet at a live switch: ``finish``
  writes them to the old backend before its client closes, ``drop`` drops
  and counts them, ``move`` hands them to the new backend (a replace only).

Pure module: names only; the admin side and the L3 tier act on them.
"""

from __future__ import annotations

from enum import StrEnum


class StorageSwitch(StrEnum):
    """admin_storage_switch's values."""

    LIVE = "live"
    IDLE = "idle"


class PendingBackups(StrEnum):
    """What a live switch does with the old backend's unwritten backups."""

    FINISH = "finish"
    DROP = "drop"
    MOVE = "move"


PENDING_BACKUPS = tuple(PendingBackups)
DEFAULT_PENDING_BACKUPS = PendingBackups.FINISH
