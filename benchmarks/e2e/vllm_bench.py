"""vLLM's own client: ``vllm-hicache bench serve`` (vLLM's ``vllm bench serve``).

Datasets that need no download, with the model's local tokenizer:

* ``prefix_repetition``: ``num_prefixes`` random prefixes (documents), each
  followed by ``num_prompts / num_prefixes`` random suffixes (questions);
  the requests are shuffled, so the questions about one document interleave
  with the others'. Reusable: every request but the first of its prefix could
  reuse the prefix (block-aligned).
* ``random``: no reuse by construction. Its prompts are arithmetic token
  sequences from a random offset (``(offset + i + arange(n)) % vocab``): with
  the tests' 480-word vocabulary two prompts can start alike and share blocks,
  so the harness reports the hits the server saw (they should be 0).

The initial test request (``--ready-check-timeout-sec``) is skipped: it sends
the first prompt once more, which would be a cache hit of its own.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from e2e.servers import CLI, REPO


@dataclass(frozen=True)
class BenchServeSpec:
    name: str
    dataset: str  # "prefix_repetition" | "random"
    num_prompts: int
    output_tokens: int
    # prefix_repetition
    prefix_tokens: int = 0
    suffix_tokens: int = 0
    num_prefixes: int = 0
    # random
    input_tokens: int = 0
    request_rate: float = float("inf")
    max_concurrency: int = 0
    seed: int = 0
    # Runs on each system (noise-sensitive comparisons).
    repeats: int = 1
    # The systems to run it on (empty: every one that needs no reset).
    systems: tuple[str, ...] = ()

    def dataset_args(self) -> list[str]:
        if self.dataset == "prefix_repetition":
            return ["--prefix-repetition-prefix-len", str(self.prefix_tokens),
                    "--prefix-repetition-suffix-len", str(self.suffix_tokens),
                    "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                    "--prefix-repetition-output-len", str(self.output_tokens)]
        return ["--random-input-len", str(self.input_tokens),
                "--random-output-len", str(self.output_tokens), "--random-range-ratio", "0"]

    def reusable_tokens(self, block_size: int) -> int:
        """What a perfect cache could serve over the whole run."""
        if self.dataset != "prefix_repetition":
            return 0
        per_prefix = self.num_prompts // self.num_prefixes
        prompt = self.prefix_tokens + self.suffix_tokens
        aligned = min(self.prefix_tokens, prompt - 1) // block_size * block_size
        return self.num_prefixes * (per_prefix - 1) * aligned


def no_repeat_seed(spec: BenchServeSpec, tokenizer: Path, tries: int = 1000) -> int:
    """The first seed from ``spec.seed`` whose ``random`` prompts all start apart.

    Mirrors vLLM 0.32's ``RandomDataset`` draws (``numpy.default_rng(seed)``:
    input lengths, output lengths, then one offset in ``[0, vocab_size)`` per
    request; prompt i starts at allowed token ``(offset_i + i) % allowed``):
    two prompts with the same start are the same tokens, a cache hit in a
    benchmark meant to have none. The harness also reports the hits the
    server saw, which catches a drift of this mirror.
    """
    import numpy as np

    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    specials = {vocab[config[k]] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if isinstance(config.get(k), str) and config[k] in vocab}
    specials |= {int(i) for i in config.get("added_tokens_decoder", {})}
    vocab_size, allowed = len(vocab), len(vocab) - len(specials)
    n = spec.num_prompts
    for seed in range(spec.seed, spec.seed + tries):
        rng = np.random.default_rng(seed)
        rng.integers(spec.input_tokens, spec.input_tokens + 1, size=n)
        rng.integers(spec.output_tokens, spec.output_tokens + 1, size=n)
        offsets = rng.integers(0, vocab_size, size=n)
        if len({(int(o) + i) % allowed for i, o in enumerate(offsets)}) == n:
            return seed
    raise RuntimeError(f"no seed in [{spec.seed}, {spec.seed + tries}) without repeats")


def run(spec: BenchServeSpec, url: str, model_name: str, tokenizer: Path, out_dir: Path,
        label: str) -> dict:
    """Run one ``bench serve``; its saved result (with per-request details)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result_file = f"{label}.json"
    argv = [
        str(CLI), "bench", "serve", "--backend", "vllm", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", str(tokenizer),
        "--dataset-name", spec.dataset, *spec.dataset_args(),
        "--num-prompts", str(spec.num_prompts), "--request-rate", str(spec.request_rate),
        "--seed", str(spec.seed), "--ignore-eos", "--temperature", "0",
        "--ready-check-timeout-sec", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(out_dir),
        "--result-filename", result_file,
    ]
    if spec.max_concurrency:
        argv += ["--max-concurrency", str(spec.max_concurrency)]
    env_log = out_dir / f"{label}.log"
    start = time.monotonic()
    with open(env_log, "wb") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                              env=_env(), timeout=3600, check=False)
    if proc.returncode != 0:
        tail = "\n".join(env_log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"bench serve {label} failed ({proc.returncode}):\n{tail}")
    result = json.loads((out_dir / result_file).read_text())
    result["harness_wall_s"] = time.monotonic() - start
    return result


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env
