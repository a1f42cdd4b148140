"""Fixtures of the GPU tests: compiled Triton kernels, a calibrated spin to
hold a stream back, and where to put the timeline report
(``HICACHE_GPU_REPORT``, written by scripts/gpu_check.sh)."""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

# How long a held-back stream spins: far longer than any copy or kernel of
# these tests, so a missing wait shows as wrong bytes, deterministically.
HOLD_MS = 50.0


@pytest.fixture(scope="session")
def compiled_triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from vllm_hicache.kernels import triton_copy

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        importlib.reload(triton_copy)
    assert not triton_copy.is_interpreted()
    return triton_copy


@pytest.fixture(scope="session")
def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is missing: cannot hold a stream back")
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm up (module load)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


@pytest.fixture(scope="session")
def spin(cycles_per_ms):
    """``spin(stream, ms=HOLD_MS)``: queue a kernel that keeps ``stream``
    (None: the current stream) busy for about ``ms``."""

    def hold(stream, ms: float = HOLD_MS) -> None:
        target = stream if stream is not None else torch.cuda.current_stream()
        with torch.cuda.stream(target):
            torch.cuda._sleep(int(cycles_per_ms * ms))

    return hold


@pytest.fixture(scope="session")
def report():
    """``report(record)``: append one JSON line to $HICACHE_GPU_REPORT, if set."""
    path = os.environ.get("HICACHE_GPU_REPORT")

    def write(record: dict) -> None:
        if path:
            with open(path, "a") as out:
                out.write(json.dumps(record) + "\n")

    return write
