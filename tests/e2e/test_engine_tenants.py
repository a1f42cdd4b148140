"""Shared L3 without trust, on a real vLLM CPU engine with the file backend and
a storage secret: requests with different ``cache_salt`` never share an L2
page or an L3 object (same salt does), and objects planted in the store by
someone without the secret are misses that leave the answer unchanged."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from tests.e2e.engine_utils import (
    BLOCK_SIZE,
    close,
    generate,
    make_llm,
    prompts_with_shared_prefix,
    scheduler_half,
)
from vllm_hicache.storage.format import HEADER_BYTES, encode_header
from vllm_hicache.storage.sealing import MacCodec
from vllm_hicache.storage_secret import StorageSecret

pytestmark = pytest.mark.engine

SECRET = "tenant-test-secret-0123456789abcdef"
# One prompt of 165 tokens: 5 full blocks, a hit of 160 tokens.
PROMPT_INDEX = 1


def tenant_extra(tmp_path) -> dict:
    secret_file = tmp_path / "hicache-secret"
    secret_file.write_text(SECRET + "\n")
    return {
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {
            "path": str(tmp_path / "l3"), "prefetch_threshold": 32,
            "storage_secret": f"@{secret_file}",
        },
    }


def ask(llm, prompt: list[int], salt: str | None) -> tuple[list[int], int]:
    """Greedy output and cached tokens of one request with ``cache_salt``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=prompt)
    if salt is not None:
        request["cache_salt"] = salt
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [out] = llm.generate([request], sp, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def objects(tmp_path) -> list:
    return sorted((tmp_path / "l3").rglob("*.hckv"))


def settle(llm, tmp_path, count: int) -> None:
    """Step until at least ``count`` objects are in L3 and every backup was
    acknowledged (pages pinned by a backup cannot be reset)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        generate(llm, [[7, 8]], max_tokens=1)
        if len(objects(tmp_path)) >= count and llm.reset_prefix_cache():
            return
        time.sleep(0.2)
    raise AssertionError(f"{len(objects(tmp_path))} objects in L3, expected {count}")


def test_salts_never_share_l2_or_l3(tiny_model_dir, reference, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vllm_hicache")
    prompt, expected = prompts_with_shared_prefix()[PROMPT_INDEX], reference[PROMPT_INDEX]
    hit = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    blocks = hit // BLOCK_SIZE
    llm = make_llm(tiny_model_dir, tenant_extra(tmp_path))
    half = scheduler_half(llm)
    try:
        assert ask(llm, prompt, "alice") == (expected, 0)
        settle(llm, tmp_path, 1 + blocks)  # + the canary; L1 is empty after this

        # L2 holds alice's pages, L1 nothing: another salt gets no hit anywhere.
        l2_hits, l3_hits = half.stats.loaded_blocks, half.l3.prefetched_blocks
        assert ask(llm, prompt, "bob") == (expected, 0)
        assert ask(llm, prompt, None) == (expected, 0)
        assert (half.stats.loaded_blocks, half.l3.prefetched_blocks) == (l2_hits, l3_hits)
        settle(llm, tmp_path, 1 + 3 * blocks)
        # The same salt hits L2.
        assert ask(llm, prompt, "alice") == (expected, hit)
        assert half.stats.loaded_blocks == l2_hits + blocks

        # L3 only (L1 and L2 dropped): another salt finds nothing ...
        settle(llm, tmp_path, 1 + 3 * blocks)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert ask(llm, prompt, "carol") == (expected, 0)
        assert half.l3.prefetched_blocks == l3_hits
        # ... the same salt finds its blocks there.
        settle(llm, tmp_path, 1 + 4 * blocks)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert ask(llm, prompt, "alice") == (expected, hit)
        assert half.l3.prefetched_blocks == l3_hits + blocks
        assert half.stats.load_error_blocks == 0
    finally:
        close(llm)
    assert "objects sealed with gmac" in caplog.text  # our logs were captured ...
    assert SECRET not in caplog.text  # ... and none shows the secret


def test_forged_objects_are_misses_with_identical_outputs(tiny_model_dir, reference, tmp_path):
    """Scenario: someone who can write the shared directory but lacks the
    secret replaces every object with one of their own, under the same name:
    with valid checksums (format.py's checksum-only header), or sealed with
    another secret. Nothing of it is loaded; the answer is the reference."""
    prompt, expected = prompts_with_shared_prefix()[PROMPT_INDEX], reference[PROMPT_INDEX]
    hit = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    llm = make_llm(tiny_model_dir, tenant_extra(tmp_path))
    half = scheduler_half(llm)
    try:
        assert ask(llm, prompt, None) == (expected, 0)
        settle(llm, tmp_path, 1 + hit // BLOCK_SIZE)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert ask(llm, prompt, None) == (expected, hit)  # L3 serves it: the control
        prefetched = half.l3.prefetched_blocks
        assert prefetched > 0

        forger = MacCodec(StorageSecret(b"not-the-secret-at-all-0123456789"))
        rng = np.random.default_rng(0)
        for i, path in enumerate(objects(tmp_path)):
            key = path.name[: -len(".hckv")]
            payload = rng.integers(0, 256, path.stat().st_size - HEADER_BYTES, dtype=np.uint8)
            header = np.empty(HEADER_BYTES, np.uint8)
            if i % 2:
                forger.seal(key, payload, header)
            else:
                encode_header(key, payload, out=header)
            path.write_bytes(header.tobytes() + payload.tobytes())
        assert llm.reset_prefix_cache(reset_connector=True)
        assert ask(llm, prompt, None) == (expected, 0)
        assert half.l3.prefetched_blocks == prefetched
        assert half.stats.load_error_blocks == 0
    finally:
        close(llm)
