"""Build a tiny random-weight Llama (and a word-level tokenizer) on local disk.

Nothing is downloaded: tests run vLLM on this model, the demo on a larger
build of the same recipe (``--demo``). A model is deterministic for a given
seed and size, so every build of it is the same model.

    python examples/tiny_model.py [DIR]
    python examples/tiny_model.py --demo [DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "tiny-llama"
DEMO_DIR = DEFAULT_DIR.parent / "demo-llama"
VOCAB_WORDS = 480  # "w0" .. "w479"; the rest of the 512 ids are specials/unused
# The demo's model (about 24M parameters, 95 MB): large enough that prefill
# costs visible time on one CPU core (about 0.5 s for 1,000 tokens), so time to
# first token with and without HiCache differs by more than the noise.
DEMO_SIZE = {"num_layers": 6, "hidden_size": 512, "intermediate_size": 2048, "num_heads": 8}


def build_tiny_llama(
    out_dir: str | os.PathLike = DEFAULT_DIR,
    *,
    dtype: str = "float32",
    num_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Write the model to ``out_dir`` once; return its path."""

    def make_model():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=512, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=2,
            head_dim=hidden_size // num_heads, max_position_embeddings=2048, torch_dtype=dtype,
            bos_token_id=1, eos_token_id=2,
        )
        return LlamaForCausalLM(config).to(getattr(torch, dtype))

    return build_once(out_dir, seed, make_model)


def build_once(out_dir: str | os.PathLike, seed: int, make_model) -> Path:
    """Seed torch, build ``make_model()`` and save it with the word-level
    tokenizer under ``out_dir``, unless a finished build is already there
    (the ``.complete`` stamp, written last); return the directory."""
    out = Path(out_dir)
    stamp = out / ".complete"
    if stamp.exists():
        return out
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    make_model().save_pretrained(out)
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
    args = sys.argv[1:]
    if args[:1] == ["--demo"]:
        print(build_tiny_llama(args[1] if len(args) > 1 else DEMO_DIR, **DEMO_SIZE))
    else:
        print(build_tiny_llama(args[0] if args else DEFAULT_DIR))
