"""Secrets out of what is shown: backend options and errors, before they
reach a log line or an HTTP answer.

An option whose name looks secret (password, token, key, ...: matched
case-insensitively anywhere in the name, at any depth) shows as
``<redacted>``; so does the ``user:password@`` part of a URL-like value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_SECRET_NAME = re.compile(
    r"pass|secret|token|credential|auth|private|api_?key|access_?key|(^|_)key$", re.I
)
# user:password@ in a URL-like value.
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
REDACTED = "<redacted>"


def redacted(value: Any) -> Any:
    """``value`` (backend options) with secrets replaced, for logs."""
    if isinstance(value, Mapping):
        return {
            k: REDACTED if _SECRET_NAME.search(str(k)) else redacted(v) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(REDACTED + "@", value)
    return value


def shown_error(err: BaseException) -> str:
    """An error for an HTTP answer or a log: URL credentials redacted."""
    return redacted(f"{type(err).__name__}: {err}")
