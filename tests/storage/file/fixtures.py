"""Fixtures shared by the ``file`` backend's test modules (imported by name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.storage.conformance import make


@pytest.fixture
def root(tmp_path):
    return tmp_path / "l3"


@pytest.fixture
def spec(root):
    return ("file", {"path": str(root)})


@pytest.fixture
def backend(spec):
    b = make(spec)
    yield b
    b.close()


@pytest.fixture
def build(spec):
    """``build(**options)``: a backend on ``root`` with extra options, closed after."""
    made = []

    def build_one(**options):
        made.append(make((spec[0], {**spec[1], **options})))
        return made[-1]

    yield build_one
    for b in made:
        b.close()


def object_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/*.hckv"))
