"""The admin API key made at start (``admin_api_key="auto"``, the default).

Format and invariant: the file (config_admin.admin_key_file: ``admin-api-<port>.key``
in ``admin_api_key_dir``) holds the key, 43 URL-safe characters (256 random
bits), and a newline, so ``curl -H "Authorization: Bearer $(cat FILE)"``
works. It is created with mode 0600 in a directory that only its owner can
write (made 0700 when missing), under a temporary name and renamed into
place, so a reader never sees half a key; a new start replaces it. A clean
shutdown of the connector removes it; vLLM may kill the engine process at
exit instead, leaving the key of a server that is gone (useless, replaced at
the next start). Whoever can read the file can call the API: the user
running vLLM, as with Jupyter's token.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_BYTES = 32


def write_key_file(path: Path) -> str:
    """Make a key, write it to ``path`` (0600) and return it."""
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as err:
        raise ValueError(f"HiCache admin API: cannot create admin_api_key_dir {str(directory)!r} "
                         f"for the key file: {err.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"HiCache admin API: admin_api_key_dir {str(directory)!r} must be a directory "
            "owned by this user that no one else can write (the key file in it opens the "
            "admin API); set admin_api_key_dir to such a directory")
    key = secrets.token_urlsafe(KEY_BYTES)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".admin-api-", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(key + "\n")
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise ValueError(f"HiCache admin API: cannot write the key file {str(path)!r}: "
                         f"{err.strerror}") from None
    return key


def remove_key_file(path: Path, key: str) -> None:
    """Remove ``path`` if it still holds ``key`` (a newer start's is kept)."""
    try:
        if path.read_text().strip() == key:
            path.unlink()
    except OSError as err:
        logger.debug("HiCache admin API: key file %s not removed: %s", path, err)
