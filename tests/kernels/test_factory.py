"""make_transfer: backend choice and the kernel -> direct fallback."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from tests.kernels.test_transfer import build
from vllm_hicache.kernels import DirectTransfer, KernelTransfer, make_transfer
from vllm_hicache.kernels import base as base_module


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(base_module, "_warned", set())


def test_direct_is_direct():
    layers, layouts, pool = build("cpu", "page_first_direct")
    assert isinstance(make_transfer("direct", layers, layouts, pool), DirectTransfer)


def test_unknown_backend_is_refused():
    layers, layouts, pool = build("cpu", "page_first_direct")
    with pytest.raises(ValueError, match="accepted: kernel, direct"):
        make_transfer("dma", layers, layouts, pool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_kernel_without_cuda_falls_back_with_one_warning(caplog):
    layers, layouts, pool = build("cpu", "layer_first")
    with caplog.at_level(logging.WARNING, logger="vllm_hicache.kernels.base"):
        first = make_transfer("kernel", layers, layouts, pool)
        second = make_transfer("kernel", layers, layouts, pool)
    assert isinstance(first, DirectTransfer) and isinstance(second, DirectTransfer)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "direct" in warnings[0].getMessage()


def test_kernel_transfer_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from vllm_hicache.kernels import triton_copy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    importlib.reload(triton_copy)
    assert not triton_copy.is_interpreted()
    layers, layouts, pool = build("cpu", "layer_first")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        KernelTransfer(layers, layouts, pool)
