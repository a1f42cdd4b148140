"""Secrets out of what is shown: logs, reprs, admin API answers and errors.

Invariant: ``redacted`` replaces by ``<redacted>``

- the value of every mapping entry whose name looks like a secret
  (``password``, ``storage_secret``, ``access_key``, ``token`` ...), at any
  depth;
- in every string, a URL's ``user:password@`` and the value of each URL
  query argument whose name looks like a secret (``?password=...``,
  ``&auth_token=...``).

Names are matched, not values: a secret under an innocent name (``url`` with
the password in its path) is not found, which is why the backends refuse
secrets in URLs. Pure module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"

# Option names whose values are never shown (matched case-insensitively
# anywhere in the name).
_SECRET_NAME = re.compile(
    r"pass|secret|token|credential|auth|private|api_?key|access_?key|(^|_)key$", re.I
)
# user:password@ in a URL-like value.
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
# name=value after "?", "&" or ";": group 1 is the name and "=".
_QUERY_ARG = re.compile(r"(?<=[?&;])([^=&;#\s?]+=)([^&;#\s]*)")


def is_secret_name(name: Any) -> bool:
    """Does an option (or query argument) of this name hold a secret?"""
    return bool(_SECRET_NAME.search(str(name)))


def redacted(value: Any) -> Any:
    """``value`` (options, a URL, an error message) with secrets replaced."""
    if isinstance(value, Mapping):
        return {k: REDACTED if is_secret_name(k) else redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    if isinstance(value, str):
        value = _URL_USERINFO.sub(REDACTED + "@", value)
        return _QUERY_ARG.sub(_redact_query_arg, value)
    return value


def _redact_query_arg(match: re.Match) -> str:
    name = match.group(1)
    return name + REDACTED if is_secret_name(name[:-1]) else match.group(0)


def shown_error(err: BaseException) -> str:
    """An error for an HTTP answer or a log, with its secrets redacted."""
    return redacted(f"{type(err).__name__}: {err}")
