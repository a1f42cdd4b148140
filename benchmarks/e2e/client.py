"""The multi-turn client: OpenAI ``/v1/completions``, token-id prompts, streamed.

Per round every session sends one request, at Poisson arrival times, in a
random order; the round ends when every answer is in (a barrier, as SGLang's
``bench_multiturn.py --enable-round-barrier``), then the next round's prompts
are built from the answers' token ids. Time to first token (TTFT) is measured
to the first streamed chunk carrying a token; end-to-end latency to the last.
Cached prompt tokens come from the usage the server streams at the end
(``--enable-prompt-tokens-details``).

Between rounds a hook may run (the harness uses it to empty L1 and L2, so that
every hit of the next round comes from L3).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aiohttp

from e2e.workloads import ReuseTracker, WorkloadSpec, arrival_order, make_sessions

REQUEST_TIMEOUT_S = 600


@dataclass
class RequestResult:
    round: int
    session: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reusable_tokens: int
    ttft_s: float
    e2e_s: float
    sent_at_s: float  # from the round's start
    error: str = ""


class Progress:
    """A one-line text progress bar on stderr (plain lines when not a TTY)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()

    def step(self, note: str = "") -> None:
        self.done += 1
        if self.tty:
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(f"\r  {self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                             f"{self.done}/{self.total} {time.monotonic() - self.start:5.0f} s "
                             f"{note}   ")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    def line(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(f"  {self.label}: {text}\n")
        sys.stderr.flush()


async def _complete(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                    max_tokens: int) -> tuple[float, float, list[int], int, int]:
    """Stream one completion; (ttft, e2e, output ids, prompt tokens, cached tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    start = time.perf_counter()
    ttft, output, usage = 0.0, [], {}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and not output:
                    ttft = time.perf_counter() - start
                output.extend(ids)
            usage = chunk.get("usage") or usage
    e2e = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return ttft, e2e, output, usage.get("prompt_tokens", len(prompt)), \
        details.get("cached_tokens") or 0


async def _run_async(spec: WorkloadSpec, url: str, model: str, block_size: int,
                     label: str, between_rounds: Callable[[int], None] | None,
                     max_inflight: int) -> tuple[list[RequestResult], list[float]]:
    sessions = make_sessions(spec)
    tracker = ReuseTracker(block_size)
    results: list[RequestResult] = []
    round_walls: list[float] = []
    limit = asyncio.Semaphore(max_inflight if max_inflight > 0 else 1 << 30)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    progress = Progress(label, spec.sessions * spec.rounds)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     trust_env=False) as http:
        for r in range(spec.rounds):
            if between_rounds is not None and r > 0:
                await asyncio.to_thread(between_rounds, r)
            order, times = arrival_order(spec, r)
            prompts = {sid: sessions[sid].prompt(r, spec.accumulate) for sid in order}
            outputs: dict[int, list[int]] = {}
            round_start = time.perf_counter()

            async def one(sid: int, at: float) -> RequestResult:
                await asyncio.sleep(max(0.0, round_start + at - time.perf_counter()))
                prompt = prompts[sid]
                sent = time.perf_counter() - round_start
                async with limit:
                    try:
                        ttft, e2e, out, n_prompt, cached = await _complete(
                            http, url, model, prompt, spec.output_tokens)
                        err = ""
                    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                        ttft, e2e, out, n_prompt, cached = 0.0, 0.0, [], len(prompt), 0
                        err = repr(exc)[:300]
                outputs[sid] = out
                progress.step(f"round {r + 1}/{spec.rounds}")
                return RequestResult(r + 1, sid, n_prompt, len(out), cached,
                                     tracker.reusable(prompt), ttft, e2e, sent, err)

            done = await asyncio.gather(*(one(sid, at) for sid, at in zip(order, times)))
            round_walls.append(time.perf_counter() - round_start)
            results.extend(done)
            for sid in order:  # the barrier: the next round sees every answer
                tracker.computed(prompts[sid], outputs[sid])
                sessions[sid].record(prompts[sid], outputs[sid], spec.accumulate)
            errors = sum(1 for d in done if d.error)
            if errors:
                progress.line(f"round {r + 1}: {errors} failed requests, e.g. "
                              f"{next(d.error for d in done if d.error)}")
            if not progress.tty:
                progress.line(f"round {r + 1}/{spec.rounds} done in {round_walls[-1]:.1f} s")
    return results, round_walls


def run_workload(spec: WorkloadSpec, url: str, model: str, block_size: int, label: str,
                 between_rounds: Callable[[int], None] | None = None,
                 max_inflight: int = 0) -> dict:
    """Run every round; per-request results and per-round wall times."""
    results, walls = asyncio.run(_run_async(spec, url, model, block_size, label,
                                            between_rounds, max_inflight))
    return {"spec": asdict(spec), "requests": [asdict(r) for r in results],
            "round_wall_s": walls}
