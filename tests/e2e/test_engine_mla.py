"""MLA (a tiny DeepSeek-V2) on the real vLLM CPU engine: the geometry the
connector derives, the save path (L2 pages hold exactly the latent KV vLLM
computed), loads (the latent KV that comes back into L1 is byte for byte what
was computed), and one L3 copy per prefix: with TP=2 the latent cache is
replicated on every rank, rank 0 writes the one copy and both ranks read it.

Both of vLLM's CPU MLA backends: the reference CPU_MLA (blocks of 16) and,
on a CPU with AMX tiles, AMX_MLA (blocks of 32), whose latent cache the
connector must read the same way; each test names its backend, since vLLM
would otherwise pick by CPU.

Not checked here: greedy outputs after a load. vLLM's CPU platform turns
prefix caching off for CPU_MLA because its prefill does not handle a cached
context: with externally loaded KV its output differs from recomputation
(vLLM's own connectors too), so output equality needs a GPU:
scripts/mla_gpu_check.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.e2e.engine_utils import (
    ByteAudit,
    close,
    generate,
    make_llm,
    scheduler_half,
    settle_backups,
    worker_half,
)
from tests.mla_model import MLA_LATENT, build_tiny_deepseek_v2

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]
MLA_BLOCK = 16  # the reference CPU MLA backend's only block size
# vLLM picks AMX_MLA where the CPU has AMX tiles (blocks of 32, and prefix
# caching on); named explicitly, so each test knows which one it runs.
MLA_BACKEND = "CPU_MLA"
BLOCK_OF = {"CPU_MLA": MLA_BLOCK, "AMX_MLA": 32}
HAS_AMX = torch.cpu._is_amx_tile_supported()


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [3 + (seed * 97 + i * 29) % 470 for i in range(num_tokens)]


PROMPTS = [prompt(1, 150), prompt(2, 93)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_deepseek_v2(REPO / ".cache" / "tiny-dsv2")


@pytest.fixture(scope="module", params=[
    "CPU_MLA",
    pytest.param("AMX_MLA", marks=pytest.mark.skipif(
        not HAS_AMX, reason="vLLM's AMX_MLA backend needs a CPU with AMX tiles")),
])
def llm(model_dir, tmp_path_factory, request):
    l3 = tmp_path_factory.mktemp("mla-l3")
    engine = make_llm(model_dir, {
        "hicache_io_backend": "direct", "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(l3), "prefetch_threshold": 16},
    }, dtype="bfloat16", block_size=BLOCK_OF[request.param], kv_bytes=4 << 20,
        attention_backend=request.param)
    engine.l3_dir = l3
    engine.backend, engine.block = request.param, BLOCK_OF[request.param]
    yield engine
    close(engine)


def full_blocks(llm) -> list[int]:
    """Tokens of each prompt in full blocks before its last token: its hit."""
    return [(n - 1) // llm.block * llm.block for n in map(len, PROMPTS)]


def test_geometry_is_one_latent_plane(llm):
    w = worker_half()
    geom = w.geom
    assert geom.is_mla and geom.block_size == llm.block and geom.num_kv_heads == 1
    assert geom.head_size == MLA_LATENT and geom.num_layers == 2
    assert geom.bytes_per_block == 2 * llm.block * MLA_LATENT * 2  # layers x tokens x latent x bf16
    assert w.pool.bytes_per_page == geom.bytes_per_block


def test_l2_hits_load_the_computed_latent_kv(llm):
    """The latent KV that comes back is byte for byte what was computed. With
    AMX_MLA, which keeps vLLM's prefix caching on, a hit loaded from L2 also
    answers exactly as vLLM's own cached hit of the same prefix (both differ
    from recomputing it: vLLM's bf16 prefill over a cached context)."""
    audit = ByteAudit(worker_half())
    _, cached = generate(llm, PROMPTS)
    assert cached == [0, 0]
    assert audit.by_page  # the save path ran
    own, own_cached = generate(llm, PROMPTS)  # AMX_MLA: vLLM's own L1 hits
    assert llm.reset_prefix_cache()  # L1 only: the next hits load from L2
    loaded_before = scheduler_half(llm).stats.loaded_blocks
    loaded, cached = generate(llm, PROMPTS)
    assert cached == full_blocks(llm)
    assert scheduler_half(llm).stats.loaded_blocks - loaded_before == sum(cached) // llm.block
    if llm.backend == "AMX_MLA":
        assert own_cached == full_blocks(llm) and loaded == own
    assert audit.checked_blocks > 0 and audit.mismatches == 0 and audit.unknown_pages == 0


def test_negative_control_corrupt_l2_is_what_loads(llm):
    """The loaded blocks are the L2 pages: corrupted pages come back corrupted
    (and with AMX_MLA, the answers then differ from vLLM's own cached hit:
    the equality in the test above can fail)."""
    llm.reset_prefix_cache(reset_connector=True)
    for p in Path(llm.l3_dir).rglob("*.hckv"):
        p.unlink()  # computed and stored again, not loaded from L3
    audit = ByteAudit(worker_half())
    generate(llm, PROMPTS)
    own, _ = generate(llm, PROMPTS)  # AMX_MLA: vLLM's own L1 hits
    checked, mismatched = audit.checked_blocks, audit.mismatches
    buf = worker_half().pool.buffer
    gen = torch.Generator().manual_seed(0)
    buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype) * 10)
    assert llm.reset_prefix_cache()  # L1 only: the next hits load from L2
    bad, cached = generate(llm, PROMPTS)
    assert sum(cached) > 0 and audit.checked_blocks > checked
    # Every block of this pass came from the bad pages.
    assert audit.mismatches - mismatched == audit.checked_blocks - checked
    if llm.backend == "AMX_MLA":
        assert bad != own
    llm.reset_prefix_cache(reset_connector=True)


def test_one_l3_copy_and_l3_hits(llm):
    llm.reset_prefix_cache(reset_connector=True)
    generate(llm, PROMPTS)
    settle_backups(llm)
    objects = list(Path(llm.l3_dir).rglob("*.hckv"))
    # One copy per block: no TP rank in the name (a name is namespace + block hash).
    assert objects and {p.name.split("-")[2] for p in objects} == {"mla"}
    assert llm.reset_prefix_cache(reset_connector=True)
    assert scheduler_half(llm).tree.num_cached_pages == 0
    loaded_before = scheduler_half(llm).stats.loaded_blocks
    _, cached = generate(llm, PROMPTS)
    assert cached == full_blocks(llm)
    assert scheduler_half(llm).stats.loaded_blocks - loaded_before == sum(cached) // llm.block
    assert scheduler_half(llm).stats.load_error_blocks == 0


def test_tp2_rank0_writes_one_copy_every_rank_reads(model_dir, tmp_path):
    """Both ranks load the hit (a rank that could not would fail the load:
    the scheduler counts a hit only when every rank acknowledges it)."""
    script = textwrap.dedent(f"""
        from tests.e2e.l3_objects import await_objects
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        extra = {{"hicache_io_backend": "direct", "hicache_storage_backend": "file",
                  "hicache_storage_prefetch_policy": "wait_complete",
                  "hicache_storage_backend_extra_config": {{"path": {str(tmp_path / "l3")!r},
                                                           "prefetch_threshold": 16}}}}
        ktc = KVTransferConfig(kv_connector="HiCacheConnector",
                               kv_connector_module_path="vllm_hicache", kv_role="kv_both",
                               kv_connector_extra_config=extra,
                               kv_load_failure_policy="recompute")
        llm = LLM(model={str(model_dir)!r}, dtype="bfloat16", block_size={MLA_BLOCK},
                  tensor_parallel_size=2, distributed_executor_backend="mp",
                  max_model_len=512, max_num_seqs=4, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=4 << 20, skip_tokenizer_init=True,
                  attention_backend={MLA_BACKEND!r}, kv_transfer_config=ktc)
        prompt = TokensPrompt(prompt_token_ids={PROMPTS[0]!r})
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        cold = llm.generate([prompt], sp, use_tqdm=False)[0]
        await_objects({str(tmp_path / "l3")!r}, {(len(PROMPTS[0]) - 1) // MLA_BLOCK})  # one copy
        llm.generate([TokensPrompt(prompt_token_ids=[7, 8])], sp, use_tqdm=False)  # acks
        assert llm.reset_prefix_cache(reset_connector=True)
        l3 = llm.generate([prompt], sp, use_tqdm=False)[0]
        print("CACHED", l3.num_cached_tokens)
    """)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONPATH=str(REPO),
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stderr[-5000:]
    assert f"CACHED {(len(PROMPTS[0]) - 1) // MLA_BLOCK * MLA_BLOCK}" in out.stdout
    objects = list((tmp_path / "l3").rglob("*.hckv"))
    # One copy, not one per rank (r0/r1 as for other models).
    assert objects and {p.name.split("-")[2] for p in objects} == {"mla"}
