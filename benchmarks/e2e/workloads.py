"""Session workloads in rounds, and what a perfect cache could reuse of them.

A workload is a set of sessions, each sending one request per round:

* **multi-turn chat** (``accumulate=True``): round r's prompt is the whole
  conversation so far (every earlier prompt's new tokens and every answer,
  token for token as the server returned them) plus the user's next message;
* **long-document QA** (``accumulate=False``): round r's prompt is the
  session's document plus the round's question; each document is asked about
  once per round.

Prompts are token ids drawn from the model's word tokens (ids 3..482 of the
tests' word-level tokenizer), so nothing is re-tokenized and a prompt's blocks
are exactly what the server hashes.

**Reusable tokens.** With a barrier between rounds, a request can reuse at most
the longest block-aligned prefix of its prompt whose KV an earlier round
computed (prompt plus answer, less the answer's last token, which is sampled
but never fed back), capped at ``prompt_len - 1`` (vLLM always computes the
last prompt token). ``ReuseTracker`` keeps the chained hashes of every block
computed so far and answers that per request: the hit rate of an infinite
cache, which is the "theoretical reusable fraction" the benchmark compares
measured hits with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Word tokens of examples/tiny_model.py's tokenizer: <unk>, <s>, </s> are 0..2.
FIRST_WORD_ID = 3
NUM_WORDS = 480


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    kind: str  # "multiturn" | "docqa"
    sessions: int
    rounds: int
    # multiturn: tokens of every user message; docqa: of every question.
    turn_tokens: int
    output_tokens: int
    # docqa: tokens of each document (0 for multiturn).
    doc_tokens: int = 0
    # Poisson arrivals within a round, requests per second.
    request_rate: float = 1.0
    seed: int = 0
    # Runs on each system (the same prompts each time).
    repeats: int = 1

    @property
    def accumulate(self) -> bool:
        return self.kind == "multiturn"

    def final_context_tokens(self) -> int:
        """Tokens of a session's KV after its last round (its working set)."""
        per_round = self.turn_tokens + self.output_tokens
        if self.accumulate:
            return self.rounds * per_round
        return self.doc_tokens + per_round

    def working_set_blocks(self, block_size: int) -> int:
        """Distinct blocks every round together computes (an upper bound)."""
        per_round = self.turn_tokens + self.output_tokens
        if self.accumulate:
            return self.sessions * -(-self.final_context_tokens() // block_size)
        return self.sessions * (-(-self.doc_tokens // block_size)
                                + self.rounds * -(-per_round // block_size))


@dataclass
class Session:
    sid: int
    prefix: list[int]
    turns: list[list[int]]
    # multiturn: the conversation so far (prompts' new tokens and answers).
    history: list[int] = field(default_factory=list)

    def prompt(self, round_index: int, accumulate: bool) -> list[int]:
        turn = self.turns[round_index]
        if accumulate:
            return self.history + turn
        return self.prefix + turn

    def record(self, prompt: list[int], output: list[int], accumulate: bool) -> None:
        if accumulate:
            self.history = prompt + output


def make_sessions(spec: WorkloadSpec) -> list[Session]:
    rng = random.Random(f"{spec.name}/{spec.seed}")

    def words(n: int) -> list[int]:
        return [FIRST_WORD_ID + rng.randrange(NUM_WORDS) for _ in range(n)]

    return [Session(sid, words(spec.doc_tokens),
                    [words(spec.turn_tokens) for _ in range(spec.rounds)])
            for sid in range(spec.sessions)]


def arrival_order(spec: WorkloadSpec, round_index: int) -> tuple[list[int], list[float]]:
    """Sessions in a random order and their Poisson send times (s from round start)."""
    rng = random.Random(f"{spec.name}/{spec.seed}/round{round_index}")
    order = list(range(spec.sessions))
    rng.shuffle(order)
    times, now = [], 0.0
    for _ in order:
        times.append(now)
        now += rng.expovariate(spec.request_rate)
    return order, times


class ReuseTracker:
    """Chained block hashes of everything computed so far (an infinite cache)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._computed: set[int] = set()

    def _chain(self, tokens: list[int], num_blocks: int):
        parent = 0
        bs = self.block_size
        for i in range(num_blocks):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            yield parent

    def reusable(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` a perfect cache holds (block-aligned, < len)."""
        hits = 0
        for h in self._chain(prompt, (len(prompt) - 1) // self.block_size):
            if h not in self._computed:
                break
            hits += 1
        return hits * self.block_size

    def computed(self, prompt: list[int], output: list[int]) -> None:
        """Record the KV a finished request left: prompt + answer[:-1]."""
        tokens = prompt + output[:-1]
        self._computed.update(self._chain(tokens, len(tokens) // self.block_size))
