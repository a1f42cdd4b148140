"""A ``KVDataPath`` over synthetic L1 tensors in vLLM's layouts, and a
simulated forward, on CPU or CUDA. No vLLM: the GPU tests (tests/gpu/) run
on machines that have only torch and triton.

The forward is per layer, on the current (compute) stream, in vLLM's hook
order: ``wait_layer(i)`` (vLLM's ``wait_for_layer_load``), then work that
reads layer i's KV of the blocks attention would read (a snapshot: what
attention saw), then, optionally, writes of new KV into blocks (what the
forward computes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tests.kernels.kv_factory import make_kv_layers, random_bits, same_bits, strided_5d
from vllm_hicache.common.jobs import NO_COPY, BlockCopy, LoadJob
from vllm_hicache.datapath import KVDataPath, allocate_pool
from vllm_hicache.kernels import KernelTransfer, describe_kv_tensor

# Geometry of the small rigs: odd page count, two kernel-unit-friendly sizes.
LAYERS, BLOCKS, PAGES, BLOCK_SIZE, HEADS, HEAD_SIZE = 4, 24, 29, 16, 4, 64
MLA_LATENT = 576  # DeepSeek's 512 + 64 rope dims
DTYPE = torch.bfloat16
POISON_BITS = 0x7FA5  # a bf16 NaN no random fill is likely to produce everywhere


@dataclass(frozen=True)
class L1Case:
    """One attention backend's L1 tensor shape (vLLM 0.32 and legacy 5-D)."""

    backend: str
    # "4d" + KVCacheLayout name | "fa_5d" | "fi_5d" + NHD/HND | "mla"
    kind: str
    order: str = "LBNHC"


# vLLM 0.32 views every backend's KV as [B, H, N, 2D] of one allocation; NHD
# is KVCacheLayout LBNHC, HND is LBHNC, BLHNC is block-first (HiSparse).
# The 5-D tensors are older vLLM's: [2, B, N, H, D] (FlashAttention) and
# [B, 2, N, H, D] (FlashInfer), physical NHD or HND.
GPU_CASES = {
    "flash_attn_nhd": L1Case("FLASH_ATTN", "4d", "LBNHC"),
    "flash_attn_hnd": L1Case("FLASH_ATTN", "4d", "LBHNC"),
    "flashinfer_nhd": L1Case("FLASHINFER", "4d", "LBNHC"),
    "flashinfer_hnd": L1Case("FLASHINFER", "4d", "LBHNC"),
    "flash_attn_block_first": L1Case("FLASH_ATTN", "4d", "BLHNC"),
    "flash_attn_5d_nhd": L1Case("FLASH_ATTN", "fa_5d", "NHD"),
    "flashinfer_5d_hnd": L1Case("FLASHINFER", "fi_5d", "HND"),
    "mla_latent": L1Case("FLASHMLA", "mla"),
}
# The GPU layouts run on CPU tensors too (direct copies): the rig itself is
# checked here, where it can be.
CPU_CASES = {"cpu_attn": L1Case("CPU_ATTN", "4d", "LBHNC"), **GPU_CASES}

# (io backend, host layout) pairs config.resolve_conflicts can produce.
PRODUCTION_IO = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]


def _legacy_5d(case: L1Case, num_layers, num_blocks, block_size, heads, head_size, device):
    logical = ((2, num_blocks, block_size, heads, head_size) if case.kind == "fa_5d"
               else (num_blocks, 2, block_size, heads, head_size))
    order = (0, 1, 2, 3, 4) if case.order == "NHD" else (0, 1, 3, 2, 4)
    numel = 2 * num_blocks * block_size * heads * head_size
    return [strided_5d(logical, order, random_bits(numel, DTYPE, seed=layer).to(device))
            for layer in range(num_layers)]


def make_l1(case: L1Case, *, num_layers: int, num_blocks: int, block_size: int, heads: int,
            head_size: int, device: str) -> tuple[list[torch.Tensor], int, int]:
    """Per-layer L1 tensors (random bits), and the (heads, head_size) to describe them."""
    if case.kind == "mla":
        views = make_kv_layers("LBNHC", num_layers=num_layers, num_blocks=num_blocks, heads=1,
                               tokens=block_size, content=MLA_LATENT, dtype=DTYPE, device=device)
        return [v[:, 0] for v in views], 1, MLA_LATENT  # [B, N, latent]
    if case.kind in ("fa_5d", "fi_5d"):
        return (_legacy_5d(case, num_layers, num_blocks, block_size, heads, head_size, device),
                heads, head_size)
    views = make_kv_layers(case.order, num_layers=num_layers, num_blocks=num_blocks, heads=heads,
                           tokens=block_size, content=2 * head_size, dtype=DTYPE, device=device)
    return views, heads, head_size


class FailingTransfer:
    """Wraps a transfer; raises when ``should_fail(op, layer, page_ids)``.
    Records every call, failed or not, as (op, layer or None, page ids)."""

    def __init__(self, inner, should_fail: Callable[[str, int | None, tuple], bool]) -> None:
        self._inner = inner
        self._should_fail = should_fail
        self.calls: list[tuple[str, int | None, tuple[int, ...]]] = []

    def _check(self, op: str, layer, page_ids) -> None:
        self.calls.append((op, layer, tuple(page_ids)))
        if self._should_fail(op, layer, tuple(page_ids)):
            raise RuntimeError(f"injected {op} failure")

    def load_layer(self, layer_index, block_ids, page_ids) -> None:
        self._check("load_layer", layer_index, page_ids)
        self._inner.load_layer(layer_index, block_ids, page_ids)

    def load(self, block_ids, page_ids) -> None:
        self._check("load", None, page_ids)
        self._inner.load(block_ids, page_ids)

    def store(self, block_ids, page_ids) -> None:
        self._check("store", None, page_ids)
        self._inner.store(block_ids, page_ids)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Rig:
    """One data path over one case's L1 tensors, plus a simulated forward."""

    def __init__(self, case: L1Case, mem_layout: str, io_backend: str, device: str = "cpu", *,
                 num_layers: int = LAYERS, num_blocks: int = BLOCKS, num_pages: int = PAGES,
                 block_size: int = BLOCK_SIZE, heads: int = HEADS, head_size: int = HEAD_SIZE,
                 timing_events: bool = False) -> None:
        self.device = torch.device(device)
        self.layers, heads, head_size = make_l1(
            case, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
            heads=heads, head_size=head_size, device=device)
        self.layouts = [
            describe_kv_tensor(t, num_blocks=num_blocks, block_size=block_size,
                               num_kv_heads=heads, head_size=head_size,
                               is_mla=case.kind == "mla", backend_name=case.backend)
            for t in self.layers
        ]
        self.num_layers, self.num_blocks = num_layers, num_blocks
        pool = allocate_pool(num_pages, self.layouts, mem_layout, self.device)
        if self.device.type == "cuda":
            assert pool.is_pinned, "cudaHostRegister failed (memlock limit?)"
        if io_backend == "kernel" and self.device.type != "cuda":
            # make_transfer refuses CPU kernels; the interpreter runs them (tests).
            self.dp = KVDataPath(pool, KernelTransfer(self.layers, self.layouts, pool),
                                 timing_events=timing_events)
        else:
            self.dp = KVDataPath.build(self.layers, self.layouts, pool, io_backend,
                                       timing_events=timing_events)
        self.pool = pool
        first = self.layouts[0]
        self.block_shape = (first.planes, block_size, first.heads, first.head_size)

    # --- L1 contents ----------------------------------------------------------

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(list(blocks), dtype=torch.long)
        if self.device.type != "cuda":
            return index
        # Not a plain .to(): that would wait for the current stream, and the
        # ordering tests need the forward issued while copies are pending.
        return index.pin_memory().to(self.device, non_blocking=True)

    def read_layer(self, layer: int, blocks: Sequence[int]) -> torch.Tensor:
        """Layer ``layer``'s KV of ``blocks``, ``[n, planes, block_size, heads,
        head_size]`` (a copy, made on the current stream)."""
        layout = self.layouts[layer]
        cells = layout.cells(self.layers[layer])[self._index(blocks)]
        return cells.reshape(len(blocks), *self.block_shape)

    def write_layer(self, layer: int, blocks: Sequence[int], values: torch.Tensor) -> None:
        layout = self.layouts[layer]
        cells = layout.cells(self.layers[layer])
        cells[self._index(blocks)] = values.reshape(len(blocks), *cells.shape[1:])

    def read_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        """``[n, layers, planes, block_size, heads, head_size]``: what
        ``pool.read_pages`` returns for the pages they were stored in."""
        return torch.stack([self.read_layer(i, blocks) for i in range(self.num_layers)], 1)

    def random_kv(self, num_blocks: int, seed: int) -> torch.Tensor:
        """Fresh KV for ``num_blocks`` blocks of every layer, on the device."""
        shape = (num_blocks, self.num_layers, *self.block_shape)
        numel = 1
        for size in shape:
            numel *= size
        return random_bits(numel, DTYPE, seed).view(shape).to(self.device)

    def poison(self, blocks: Sequence[int]) -> None:
        bits = torch.full((len(blocks), *self.block_shape), POISON_BITS, dtype=torch.int16,
                          device=self.device)
        for layer in range(self.num_layers):
            self.write_layer(layer, blocks, bits.view(DTYPE))

    def is_poison(self, values: torch.Tensor) -> bool:
        return bool((values.view(torch.int16) == POISON_BITS).all())

    def pages(self, pages: Sequence[int]) -> torch.Tensor:
        return self.pool.read_pages(pages)

    # --- a step, in vLLM's hook order ---------------------------------------------

    def forward(self, *, read: Sequence[int] = (), write: tuple[Sequence[int], torch.Tensor]
                | None = None, work: Callable[[int], None] | None = None,
                wait: bool = True) -> list[torch.Tensor]:
        """Per layer on the current stream: wait for its loads (unless
        ``wait`` is False: a forward that skips the hook), snapshot its KV of
        ``read``, run ``work(layer)``, write ``write``'s KV. Returns the
        snapshots, one per layer."""
        snapshots = []
        for layer in range(self.num_layers):
            if wait:
                self.dp.wait_layer(layer)
            if read:
                snapshots.append(self.read_layer(layer, read).clone())
            if work is not None:
                work(layer)
            if write is not None:
                blocks, kv = write
                self.write_layer(layer, blocks, kv[:, layer])
        return snapshots

    def step(self, *, write_back: BlockCopy = NO_COPY, loads: Sequence[LoadJob] = (),
             async_loads: Sequence[LoadJob] = (), stores: BlockCopy = NO_COPY,
             forward: Callable[[], list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
        dp = self.dp
        dp.before_forward(write_back)
        dp.begin_step(loads)
        dp.start_loads(async_loads)
        snapshots = forward() if forward is not None else self.forward()
        dp.after_forward(stores)
        dp.end_step()
        return snapshots

    def store(self, blocks: Sequence[int], pages: Sequence[int], seed: int) -> torch.Tensor:
        """A step whose forward writes fresh KV into ``blocks``, stored into
        ``pages`` after it; returns that KV (``read_blocks`` order)."""
        kv = self.random_kv(len(blocks), seed)
        self.step(stores=BlockCopy(tuple(blocks), tuple(pages)),
                  forward=lambda: self.forward(write=(blocks, kv)))
        self.synchronize()
        return kv

    def poll_until(self, req_ids: set[str], timeout_s: float = 30.0) -> set[str]:
        """Poll the async loads until ``req_ids`` are all reported (bounded)."""
        assert self.dp.wait_async_loads(timeout_s), "async loads did not finish"
        finished = self.dp.poll()
        assert req_ids <= finished, (req_ids, finished)
        return finished

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.dp.transfer.synchronize()

    def close(self) -> None:
        self.synchronize()
        self.dp.shutdown()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return same_bits(a, b)
