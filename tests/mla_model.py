"""A tiny random-weight DeepSeek-V2 (MLA) model for engine tests, built locally.

vLLM's CPU MLA backend serves only a 576-wide latent (kv_lora_rank 512 +
qk_rope_head_dim 64), so those two are fixed; everything else is small.
``initializer_range`` 0.2: with the default the model emits one token for
every input. Deterministic for a seed; nothing is downloaded (the tokenizer
is the tiny Llama's word-level one).
"""

from __future__ import annotations

import os
from pathlib import Path

from tiny_model import build_once

MLA_LATENT = 512 + 64


def build_tiny_deepseek_v2(out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                           seed: int = 0) -> Path:
    """Write the model to ``out_dir`` once; return its path."""

    def make_model():
        import torch
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
            v_head_dim=64, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            max_position_embeddings=2048, initializer_range=0.2, torch_dtype=dtype,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_scaling=None,
        )
        return DeepseekV2ForCausalLM(config).to(getattr(torch, dtype))

    return build_once(out_dir, seed, make_model)
