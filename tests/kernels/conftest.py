"""Fixtures for the copy-backend tests.

The Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1``. Triton
reads that variable when a kernel is decorated, so the fixture sets it and
reloads ``triton_copy``; afterwards it reloads the module again without it,
so a later CUDA test in the same session gets compiled kernels. Only a
failing ``import triton`` skips these tests.
"""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def interpreted_triton():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from vllm_hicache.kernels import triton_copy

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(triton_copy)
        assert triton_copy.is_interpreted(), "TRITON_INTERPRET=1 did not take effect"
        yield triton_copy
    importlib.reload(triton_copy)
