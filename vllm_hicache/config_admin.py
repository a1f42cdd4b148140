"""The admin API's options as kv_connector_extra_config gives them: the
parsers of its admin_api_* values, where admin_api_key="auto" writes the key
it makes, and which hosts count as loopback.

Each parser returns the parsed value or raises ValueError saying what is
accepted (storage.options.parse_value prefixes the key and the value); an
error about admin_api_key names the file it read, never the key.
config.py declares the keys with these parsers and checks them against
each other (``_check_admin_bind``). Pure module: imports neither torch nor
vllm.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from vllm_hicache.option_file import read_option_file

# admin_api_key values: a key made at start, and no key at all.
ADMIN_KEY_AUTO = "auto"
ADMIN_KEY_NONE = "none"


def parse_admin_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError("expected an integer in [0, 65535] (0 = off)")
    return value


def parse_admin_host(value: Any) -> str:
    if not isinstance(value, str) or not value or not value.isprintable() or " " in value:
        raise ValueError("expected an address to bind, e.g. 127.0.0.1")
    return value


# A token shorter than this is refused: it would be guessable.
_ADMIN_KEY_MIN_CHARS = 16


def parse_admin_key(value: Any) -> str:
    """The key itself, ADMIN_KEY_AUTO, or "" for "none"; ``@path`` reads the
    key from a file (stripped). Errors name the file, never the key."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected {ADMIN_KEY_AUTO!r}, {ADMIN_KEY_NONE!r}, the key or "
                         "@/path/to/file holding it")
    if value == ADMIN_KEY_AUTO:
        return value
    if value == ADMIN_KEY_NONE:
        return ""
    if value.startswith("@"):
        try:
            key = read_option_file(value[1:]).decode("utf-8").strip()
        except UnicodeError:
            raise ValueError("not UTF-8 text") from None
        where = f"in {value[1:]!r}"
    else:
        key, where = value, "given"
    if len(key) < _ADMIN_KEY_MIN_CHARS or not key.isprintable() or " " in key:
        raise ValueError(f"the key {where} is refused; expected at least "
                         f"{_ADMIN_KEY_MIN_CHARS} printable characters without spaces")
    return key


def _absolute_dir(value: Any) -> str:
    path = os.path.expanduser(value) if isinstance(value, str) else ""
    if not os.path.isabs(path) or not path.isprintable():
        raise ValueError(f"entry {value!r} is not an absolute directory path")
    return os.path.normpath(path)


def parse_key_dir(value: Any) -> str:
    return "" if value == "" else _absolute_dir(value)


def parse_file_dirs(value: Any) -> tuple[str, ...]:
    """Real paths (symbolic links resolved), as the files named are checked."""
    if not isinstance(value, (list, tuple)):
        raise ValueError("expected a list of absolute directory paths, e.g. "
                         "[\"/etc/hicache\"]")
    dirs = tuple(os.path.realpath(_absolute_dir(v)) for v in value)
    if os.sep in dirs:
        raise ValueError("'/' would let a client name any file; list the directories "
                         "holding the secrets to allow")
    return dirs


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_dynamic_modules(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and _MODULE_NAME.match(v) for v in value):
        raise ValueError("expected a list of module names, e.g. [\"my_pkg.my_backend\"]")
    return tuple(value)


def admin_key_file(key_dir: str, port: int) -> Path:
    """Where admin_api_key="auto" writes the key of the admin API on
    ``port``: ``key_dir``, else $XDG_RUNTIME_DIR/vllm_hicache (a per-user
    tmpfs), else ~/.cache/vllm_hicache."""
    if not key_dir:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        key_dir = (os.path.join(runtime, "vllm_hicache") if os.path.isabs(runtime)
                   else os.path.expanduser("~/.cache/vllm_hicache"))
    return Path(key_dir) / f"admin-api-{port}.key"


def is_loopback(host: str) -> bool:
    """Does ``host`` (an admin_api_host) name a loopback address?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
