"""Build a tiny random-weight Llama (and a word-level tokenizer) on local disk.

Nothing is downloaded: tests and the demo run vLLM on this model. The model
is deterministic for a given seed, so every build of it is the same model.

    python examples/tiny_model.py [DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "tiny-llama"
VOCAB_WORDS = 480  # "w0" .. "w479"; the rest of the 512 ids are specials/unused


def build_tiny_llama(
    out_dir: str | os.PathLike = DEFAULT_DIR,
    *,
    dtype: str = "float32",
    num_layers: int = 2,
    seed: int = 0,
) -> Path:
    """Write the model to ``out_dir`` once; return its path."""
    out = Path(out_dir)
    stamp = out / ".complete"
    if stamp.exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=2048, torch_dtype=dtype,
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    _save_tokenizer(out)
    stamp.write_text("ok\n")
    return out


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def words(start: int, count: int) -> str:
    """A prompt of ``count`` distinct-ish words, for building shared prefixes."""
    return " ".join(f"w{(start + i * 7) % VOCAB_WORDS}" for i in range(count))


if __name__ == "__main__":
    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
