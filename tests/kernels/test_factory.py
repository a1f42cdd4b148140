"""make_transfer builds the resolved backend and refuses kernel copies it cannot run."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.kernels.test_transfer import build
from vllm_hicache.kernels import DirectTransfer, KernelTransfer, kernel_io_missing, make_transfer


def test_direct_is_direct():
    layers, layouts, pool = build("cpu", "page_first_direct")
    assert isinstance(make_transfer("direct", layers, layouts, pool), DirectTransfer)


def test_unknown_backend_is_refused():
    layers, layouts, pool = build("cpu", "page_first_direct")
    with pytest.raises(ValueError, match="accepted: kernel, direct"):
        make_transfer("dma", layers, layouts, pool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_kernel_without_cuda_is_refused_not_swapped():
    # The choice is config.resolve_conflicts'; the factory never falls back
    # on its own (it could not rewrite the layout that goes with it).
    layers, layouts, pool = build("cpu", "layer_first")
    with pytest.raises(ValueError, match="needs CUDA"):
        make_transfer("kernel", layers, layouts, pool)


def test_kernel_io_missing_names_cuda_on_a_cpu_device():
    assert kernel_io_missing(False) == "CUDA"


def test_kernel_transfer_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from vllm_hicache.kernels import triton_copy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    importlib.reload(triton_copy)
    assert not triton_copy.is_interpreted()
    layers, layouts, pool = build("cpu", "layer_first")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        KernelTransfer(layers, layouts, pool)
