"""The drawing of the package's imports (scripts/import_graph.py,
docs/img/imports.dot) is current, and its checks catch what they promise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grimp
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


@pytest.fixture(scope="module")
def drawing():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_drawing_is_what_the_code_imports(drawing):
    found = drawing.edges(grimp.build_graph("vllm_hicache"))
    drawing.check(found)  # no arrow up a floor, no cycle
    assert drawing.DOT.read_text() == drawing.render(found), (
        "docs/img/imports.dot is stale: run .venv/bin/python scripts/import_graph.py")


def test_an_arrow_up_a_floor_or_a_cycle_is_refused(drawing):
    with pytest.raises(SystemExit, match="running up a floor: host -> storage"):
        drawing.check({("host", "storage")})
    with pytest.raises(SystemExit, match="a cycle"):
        drawing.check({("datapath", "common"), ("common", "datapath")})
