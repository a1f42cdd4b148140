"""Synthetic L1 KV tensors shaped the way vLLM 0.32 allocates them.

vLLM views one int8 allocation as a logical ``[L, B, H, N, C]`` tensor whose
physical axis order is a ``KVCacheLayout`` (``create_kv_cache_views``); each
layer gets ``view[l]``. ``make_kv_layers`` rebuilds that without vLLM.
"""

from __future__ import annotations

import torch

# Physical order of the logical axes [L, B, H, N, C], outermost first
# (mirrors vllm.v1.kv_cache_layout.KVCacheLayout's values).
STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def random_bits(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included: compare with ``same_bits``)."""
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**7), 2**7 - 1, (numel * size,), dtype=torch.int8, generator=gen)
    return bits.view(int_type[size]).view(dtype) if size > 1 else bits.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact equality (NaN-safe)."""
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    kind = int_type[a.element_size()]
    return torch.equal(a.cpu().view(kind), b.cpu().view(kind))


def strided_5d(shape: tuple[int, ...], order: tuple[int, ...], base: torch.Tensor) -> torch.Tensor:
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    assert base.numel() >= step
    return base.as_strided(shape, strides)


def make_kv_layers(
    order_name: str,
    *,
    num_layers: int,
    num_blocks: int,
    heads: int,
    tokens: int,
    content: int,
    dtype: torch.dtype = torch.bfloat16,
    stacked: bool = True,
    device: str = "cpu",
    seed: int = 0,
) -> list[torch.Tensor]:
    """Per-layer ``[num_blocks, heads, tokens, content]`` views, filled with random bits.

    ``stacked``: all layers in one allocation (as vLLM does); otherwise one
    allocation per layer.
    """
    order = STRIDE_ORDERS[order_name]
    per_layer = num_blocks * heads * tokens * content
    if stacked:
        raw = random_bits(num_layers * per_layer, dtype, seed).to(device)
        view = strided_5d((num_layers, num_blocks, heads, tokens, content), order, raw)
        return [view[layer] for layer in range(num_layers)]
    layers = []
    for layer in range(num_layers):
        raw = random_bits(per_layer, dtype, seed + 1 + layer).to(device)
        layers.append(strided_5d((1, num_blocks, heads, tokens, content), order, raw)[0])
    return layers
