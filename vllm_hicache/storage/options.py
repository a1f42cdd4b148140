"""Shared checks for backend options: every error names the backend, the
option and what is accepted."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def reject_unknown(backend: str, options: Mapping[str, Any], accepted: Iterable[str]) -> None:
    accepted = sorted(accepted)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown {backend} backend option(s) {unknown}; accepted: {accepted}")


def require(backend: str, options: Mapping[str, Any], key: str, hint: str) -> None:
    if key not in options:
        raise ValueError(f"{backend} backend option {key!r} is required ({hint})")


def check_range(backend: str, name: str, value: float, low: float, high: float,
                *, with_low: bool = False) -> None:
    """``low < value <= high`` (``low <=`` if with_low), else a ValueError."""
    if not (low <= value if with_low else low < value) or value > high:
        interval = f"{'[' if with_low else '('}{low}, {high}]"
        raise ValueError(f"invalid {backend} backend option {name}={value!r}: must be in {interval}")
