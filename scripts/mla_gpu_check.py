"""MLA load correctness on a CUDA machine with vLLM: greedy outputs after
HiCache loads equal recomputation, and corrupted L2 pages change them.

vLLM's CPU MLA backend gives wrong output for any externally loaded KV (it
turns prefix caching off for MLA for that reason), so this check needs a
GPU and vLLM's CUDA build. It builds a tiny DeepSeek-V2 (MLA, bf16) under
.cache/tiny-dsv2, then runs, one engine at a time in this process:

    1. vLLM without a connector                   -> reference outputs
    2. HiCache (L2 + file L3 in a temp directory):
       cold, L2 hits (vLLM's prefix cache reset), L3 hits (L2 reset too),
       and the negative control (random bytes in L2, outputs must change)

and prints one line per check. Exit status: 0 all passed, 1 a check failed,
2 no CUDA device or no vLLM.

    python scripts/mla_gpu_check.py [--tp 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
EXIT_NO_GPU = 2
BLOCK = 16


def prompts() -> list[list[int]]:
    return [[3 + (s * 97 + i * 29) % 470 for i in range(n)] for s, n in ((1, 150), (2, 93))]


def engine(model: Path, tp: int, extra: dict | None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None if extra is None else KVTransferConfig(
        kv_connector="HiCacheConnector", kv_connector_module_path="vllm_hicache",
        kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    return LLM(model=str(model), dtype="bfloat16", block_size=BLOCK, tensor_parallel_size=tp,
               max_model_len=512, max_num_seqs=4, enforce_eager=True, seed=0,
               gpu_memory_utilization=0.3, skip_tokenizer_init=True, kv_transfer_config=ktc)


def run(llm) -> tuple[list[list[int]], list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], sp,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def shut(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ensure_kv_transfer_shutdown()
        gc.collect()


def corrupt_l2(llm) -> None:
    """Random bytes into every worker's host pool (runs in the workers)."""
    def scribble(worker) -> None:
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        buf = get_kv_transfer_group().worker.pool.buffer
        gen = torch.Generator().manual_seed(0)
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype) * 10)

    llm.collective_rpc(scribble)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as err:
        print(f"mla_gpu_check: refused: {err} (needs vLLM's CUDA build)", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print("mla_gpu_check: refused: no CUDA device", file=sys.stderr)
        return EXIT_NO_GPU
    from tests.mla_model import build_tiny_deepseek_v2

    model = build_tiny_deepseek_v2(REPO / ".cache" / "tiny-dsv2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    llm = engine(model, args.tp, None)
    reference, _ = run(llm)
    shut(llm)
    failures = 0

    def check(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    hit = [(len(p) - 1) // BLOCK * BLOCK for p in prompts()]
    with tempfile.TemporaryDirectory(prefix="mla-l3-") as l3:
        llm = engine(model, args.tp, {
            "hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_storage_backend_extra_config": {"path": l3, "prefetch_threshold": BLOCK}})
        try:
            cold, _ = run(llm)
            check("cold", cold == reference, f"{cold[0][:6]} vs {reference[0][:6]}")
            llm.reset_prefix_cache()
            out, cached = run(llm)
            check("L2 hits", out == reference and cached == hit, f"cached {cached}")
            llm.reset_prefix_cache(reset_connector=True)
            out, cached = run(llm)
            check("L3 hits", out == reference and cached == hit, f"cached {cached}")
            llm.reset_prefix_cache()
            corrupt_l2(llm)
            out, cached = run(llm)
            check("negative control", out != reference and sum(cached) > 0,
                  f"corrupted L2 gives {out[0][:6]}, cached {cached}")
        finally:
            shut(llm)
    print(f"mla_gpu_check: {'all passed' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
