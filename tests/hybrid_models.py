"""Tiny random-weight hybrid models for engine tests, built on local disk.

``build_tiny_gemma3``: a Gemma3-like text model whose layers alternate
sliding-window (64 tokens) and full attention, so vLLM's hybrid allocator
gives it two KV cache groups. float32, so outputs with loaded KV equal
recomputation exactly. Deterministic for a seed; nothing is downloaded (the
tokenizer is the tiny Llama's word-level one).

``build_tiny_granite_hybrid``: a GraniteMoeHybrid-like dense model whose
layers alternate Mamba2 and full attention, so vLLM's hybrid allocator gives
it a Mamba group (one recurrent state per request) and an attention group.
float32 too. Its Mamba state is kept small so that vLLM's page alignment
(attention block size raised until an attention page holds a Mamba state)
gives a short hybrid block.

``build_tiny_qwen3_next``: a Qwen3-Next-like model, one Gated DeltaNet
(linear attention) layer and one full-attention layer, each with a sparse
MoE block of two small experts (vLLM's Qwen3-Next needs one). bfloat16, the
only dtype vLLM's CPU GDN kernel runs. Its GDN state is one head of the
smallest size that kernel takes, and the attention layer is wide enough per
token that a 32-token page holds that state.

``build_tiny_qwen3_next_tp2``: the same with two heads where the first has
one (GDN key and value heads, attention KV heads), for TP=2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from tiny_model import build_once

# Tokens one sliding-window layer attends to: two 32-token blocks, so prompts
# of a few hundred tokens leave most of their sliding-window blocks behind.
GEMMA3_SLIDING_WINDOW = 64

# Qwen3-Next's GDN state: one 64x64 float32 head (16 KiB) plus a 1.1 KiB
# conv state; 64 is the smallest head dim the CPU GDN kernel takes (32 and 96
# fail: "Unexpected head dim size"). The full-attention layer keeps 1 KiB of
# bfloat16 K and V per token, so a 32-token page (32 KiB) holds that state and
# vLLM keeps 32-token blocks (with 512 B per token it raises them to 64).
QWEN3_NEXT_LINEAR_HEAD_DIM = 64
QWEN3_NEXT_HEAD_DIM = 256


def build_tiny_gemma3(out_dir: str | os.PathLike, *, num_layers: int = 4,
                      seed: int = 0, tie_word_embeddings: bool = True) -> Path:
    """Write the model to ``out_dir`` once; return its path.

    Tied embeddings (Gemma3's default) make it mostly repeat a token: the
    input embedding, scaled by sqrt(hidden), dominates the residual stream,
    so the output head scores the current token highest whatever the
    context. ``tie_word_embeddings=False`` gives a model whose greedy
    output follows the context (KV from far back changes it), for tests
    that need a context-dependent answer. Give each variant its own
    ``out_dir``: a finished build is never rebuilt.
    """

    def make_model():
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, sliding_window=GEMMA3_SLIDING_WINDOW,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(num_layers)],
            max_position_embeddings=2048, torch_dtype="float32",
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=tie_word_embeddings,
        )
        return _widened(Gemma3ForCausalLM(config))

    return build_once(out_dir, seed, make_model)


def build_tiny_granite_hybrid(out_dir: str | os.PathLike, *, num_layers: int = 4,
                              seed: int = 0) -> Path:
    """Write the model to ``out_dir`` once; return its path."""

    def make_model():
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
            num_local_experts=0, num_experts_per_tok=0,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(num_layers)],
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=32,
            position_embedding_type="rope", max_position_embeddings=2048,
            torch_dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        return _widened(GraniteMoeHybridForCausalLM(config))

    return build_once(out_dir, seed, make_model)


def build_tiny_qwen3_next(out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the model to ``out_dir`` once; return its path. bfloat16: vLLM's
    CPU GDN kernel refuses float32 ("CPU GDN attention requires BF16")."""
    return _build_qwen3_next(out_dir, seed, heads=1)


def build_tiny_qwen3_next_tp2(out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """``build_tiny_qwen3_next`` with two GDN key heads, two GDN value heads
    and two attention KV heads, so TP=2 splits every layer and each rank's
    GDN state and attention page are those of the one-head model (a 32-token
    page holds the state)."""
    return _build_qwen3_next(out_dir, seed, heads=2)


def _build_qwen3_next(out_dir: str | os.PathLike, seed: int, *, heads: int) -> Path:
    def make_model():
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            # vLLM's Qwen3-Next needs a sparse MoE block; two small experts.
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, mlp_only_layers=[], decoder_sparse_step=1,
            num_attention_heads=2, num_key_value_heads=heads, head_dim=QWEN3_NEXT_HEAD_DIM,
            linear_num_key_heads=heads, linear_num_value_heads=heads, linear_conv_kernel_dim=4,
            linear_key_head_dim=QWEN3_NEXT_LINEAR_HEAD_DIM,
            linear_value_head_dim=QWEN3_NEXT_LINEAR_HEAD_DIM,
            max_position_embeddings=2048, torch_dtype="bfloat16",
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        model = _widened(Qwen3NextForCausalLM(config))
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "linear_attn"):
                    # Slow decay (about 6% per token; the default init draws
                    # up to 16x), so a restored state still shapes the
                    # tokens after it.
                    layer.linear_attn.A_log.fill_(math.log(0.05))
        return model.to(torch.bfloat16)

    return build_once(out_dir, seed, make_model)


def _widened(model):
    """float32, with weights drawn wider than the default init: that leaves
    outputs nearly input-independent, and every token (so every loaded block
    or state) must change them."""
    import torch

    model = model.to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model
