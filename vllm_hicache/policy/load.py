"""Load decisions: load a hit only where loading beats recomputing it.

A hit is worth loading only if copying it in takes less time than vLLM would
spend computing the same tokens. Slow storage, a congested network or small
pages can make a tier slower than the model (an L3 read at 100 MB/s against
a GPU that prefills 10k tokens a second of a 70B model's 320 kB/token KV is
a loss). ``hicache_load_decision``:

- ``always``: load every hit (the behaviour before these decisions existed).
- ``auto``: per request, compare the expected load time of the hit with the
  expected compute time of its tokens, from estimates measured as the
  server runs; decline the hit (vLLM recomputes it) where loading is
  expected to be slower by more than ``LOAD_MARGIN``.

Estimators (all pure, fed by the connector; ``scheduler/load_gate.py``):

- **Bandwidth per tier** (``BandwidthEstimate``): bytes and seconds of each
  copy kind as the workers report them every step (``transfer_bytes`` /
  ``transfer_seconds``, summed over TP ranks, so their ratio is one rank's
  bandwidth): L2 -> L1 ``load``, L3 -> L2 ``prefetch``. A sample is one
  step's bytes over its seconds (on CUDA a copy's seconds arrive a step or
  two after its bytes: both are accumulated until each is non-zero); the
  estimate is the median of the last ``BANDWIDTH_WINDOW`` samples, so one
  copy that was descheduled for 10 ms does not flip decisions. Bias: a
  ratio of bytes to seconds ignores a per-call latency, so small transfers
  are predicted a little faster than they are; queueing behind other
  prefetches is not modelled either (the prefetch policy's deadline still
  bounds the wait).
- **Prefill cost** (``PrefillModel``): the engine's step time, measured in
  the scheduler process from the end of ``build_connector_meta`` of step N
  to the ``update_connector_output`` of its result (or from the previous
  result, when vLLM's async scheduling planned step N before N-1 ended),
  fitted as ``T = c_tok x N + c_attn x A``, with ``N`` the step's scheduled
  tokens and ``A = sum over requests of n x (context + (n + 1) / 2)`` its
  attention (query x key pairs): a linear model of a token's cost in its
  context. Decayed least squares (``PREFILL_DECAY`` per sample) over steps
  that mostly prefill (decode-only steps are dominated by reading weights,
  not by tokens) and that load nothing layer by layer (a load inside the
  forward would be counted as compute). Once fitted, a sample is clipped to
  [1/``CLIP``, ``CLIP``] x its prediction, so a stalled step moves the fit
  a bounded amount while a real change still wins in a few steps.
  Bias: there is no intercept, so a step's fixed cost (scheduling, sampling,
  reading the weights) is spread over its tokens. That is right when
  prefills are chunked at the token budget (each token then costs its share
  of a step) and over-states the marginal cost of a short prefill: the
  estimate errs towards loading.

- **L3 latency** (``observe_l3_latency``): the seconds of the planner's
  recent L3 lookups (one round trip each), median of the last
  ``BANDWIDTH_WINDOW``: the fixed cost a fetch pays however short it is,
  which a ratio of bytes to seconds leaves out. It is what makes short hits
  (a few blocks) lose against recomputing on a store far away, and win on
  a near one (``prefetch_threshold=auto``, policy/prefetch.py).

Decision for a hit of ``n`` tokens after ``start`` cached ones, over
``pages`` pages of ``page_bytes``:

    load_s    = pages x page_bytes / bandwidth        (L3: latency + prefetch + load)
    compute_s = c_tok x n + c_attn x n x (start + (n + 1) / 2)
    decline  iff  load_s > (1 + LOAD_MARGIN) x compute_s

All or nothing: per-page load cost is flat while a token's compute cost
grows with its position, so if the whole hit is not worth loading, no prefix
of it is. The model is sequential (load, then compute the rest), exact for
``hicache_load_mode=async`` and pessimistic about layer-wise loads on CUDA,
which overlap the forward; with the margin, ties go to loading, which also
frees compute for other requests. Cold start: until the tier's bandwidth
has ``MIN_BANDWIDTH_SAMPLES`` samples and the prefill model ``MIN_SAMPLES``,
hits are loaded. Estimates must stay fresh, or a tier whose hits are all declined
could never show it got faster (a congestion that passed): an L2 estimate
no sample refreshed for ``PROBE_INTERVAL_S`` lets one hit through (a probe,
which costs that request at most the load it would have declined); for L3,
every ``L3_PROBE_INTERVAL_S``, ``wants_l3_sample`` asks the planner to
prefetch part of a declined hit that nobody waits for (no request pays for
it). The median needs a majority of its window to move, so a tier that
recovered is trusted again after a few probes (about a minute for L3).

Default ``auto``: it protects deployments from a tier nobody knew was slow
(shared storage under contention, a store in another zone, pages made
small by a small block size), and costs little where tiers are fast: hits
are loaded until measured, declined only beyond the margin, and a declined
L2 hit keeps its pages (a declined L3 hit's prefetch may still run for
later requests). ``always`` remains for exact hit accounting (tests,
benchmarks of the tiers themselves).

Pure module: no torch, no vllm.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum


class LoadDecision(StrEnum):
    """hicache_load_decision's values (a str: compares and prints as its name)."""

    ALWAYS = "always"
    AUTO = "auto"


LOAD_DECISIONS = tuple(LoadDecision)

# Decline only where loading is expected to take this much longer than computing.
LOAD_MARGIN = 0.2
# Samples needed before an estimate is used (until then: load). A sample of
# L3 is one step in which prefetch reads finished: a cold start costs the
# first requests with L3 hits their wait. Three: the median then outlives
# one outlier (a copy descheduled by another process).
MIN_SAMPLES = 3
MIN_BANDWIDTH_SAMPLES = 3
# Bandwidth: median of this many recent samples.
BANDWIDTH_WINDOW = 9
# Prefill model: weight of older samples per new one (about 20 samples of memory).
PREFILL_DECAY = 0.95
# Once fitted, a step's time counts at most CLIP x (at least 1/CLIP x) its prediction.
CLIP = 2.0
# A step is a prefill sample if at least this many tokens, and at least half
# of its tokens, belong to requests scheduled for more than one token.
MIN_PREFILL_TOKENS = 16
# An L2 estimate not refreshed for this long lets one hit through (costs
# that request's TTFT); an L3 one asks for a background read (costs nobody).
PROBE_INTERVAL_S = 30.0
L3_PROBE_INTERVAL_S = 10.0
# Steps measured longer than this are not samples (a debugger, a suspended host).
MAX_STEP_S = 60.0


class BandwidthEstimate:
    """Bytes per second of one copy kind (see module doc)."""

    def __init__(self, window: int = BANDWIDTH_WINDOW,
                 min_samples: int = MIN_BANDWIDTH_SAMPLES) -> None:
        self._rates: deque[float] = deque(maxlen=window)
        self._bytes = 0.0
        self._seconds = 0.0
        self.min_samples = min_samples
        self.samples = 0

    def observe(self, num_bytes: float, seconds: float) -> bool:
        """Add one step's report; True if it completed a sample."""
        if num_bytes < 0 or seconds < 0:
            return False
        self._bytes += num_bytes
        self._seconds += seconds
        if self._bytes <= 0 or self._seconds <= 0:
            return False
        self._rates.append(self._bytes / self._seconds)
        self._bytes = self._seconds = 0.0
        self.samples += 1
        return True

    @property
    def ready(self) -> bool:
        return len(self._rates) >= self.min_samples

    def bytes_per_s(self) -> float | None:
        if not self.ready:
            return None
        ordered = sorted(self._rates)
        mid = len(ordered) // 2
        if len(ordered) % 2:
            return ordered[mid]
        return (ordered[mid - 1] + ordered[mid]) / 2

    def reset(self) -> None:
        self._rates.clear()
        self._bytes = self._seconds = 0.0


def attention_pairs(num_tokens: int, context: int) -> float:
    """Query x key pairs of ``num_tokens`` tokens computed after ``context``
    cached ones (each attends to everything before it and itself)."""
    return num_tokens * (context + (num_tokens + 1) / 2)


class PrefillModel:
    """Step time as ``c_tok x tokens + c_attn x attention pairs`` (see module doc)."""

    # Units that keep the 2x2 system well conditioned.
    _N_UNIT = 1e3
    _A_UNIT = 1e6

    # Fitted state, emptied by reset(): steps observed, the decayed sums of
    # the normal equations (n: tokens, a: attention pairs, t: seconds) and
    # the fit (None while cold).
    samples: int
    _snn: float
    _sna: float
    _saa: float
    _snt: float
    _sat: float
    _coef: tuple[float, float] | None

    def __init__(self, decay: float = PREFILL_DECAY, min_samples: int = MIN_SAMPLES,
                 clip: float = CLIP) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.clip = clip
        self.reset()

    def observe(self, num_tokens: int, attn_pairs: float, seconds: float) -> None:
        if num_tokens <= 0 or not 0 < seconds <= MAX_STEP_S:
            return
        if self._coef is not None:
            predicted = self._predict(num_tokens, attn_pairs)
            if predicted > 0:
                seconds = min(max(seconds, predicted / self.clip), predicted * self.clip)
        n, a = num_tokens / self._N_UNIT, attn_pairs / self._A_UNIT
        d = self.decay
        self._snn = d * self._snn + n * n
        self._sna = d * self._sna + n * a
        self._saa = d * self._saa + a * a
        self._snt = d * self._snt + n * seconds
        self._sat = d * self._sat + a * seconds
        self.samples += 1
        if self.samples >= self.min_samples:
            self._coef = self._fit()

    def _fit(self) -> tuple[float, float] | None:
        snn, sna, saa, snt, sat = self._snn, self._sna, self._saa, self._snt, self._sat
        if snn <= 0:
            return None
        # A little ridge: with steps of one shape, tokens and attention are
        # collinear and the split between them is arbitrary (predictions at
        # that shape are not).
        ridge = 1e-6 * (snn + saa)
        snn_r, saa_r = snn + ridge, saa + ridge
        det = snn_r * saa_r - sna * sna
        c_n = c_a = -1.0
        if det > 0:
            c_n = (snt * saa_r - sat * sna) / det
            c_a = (sat * snn_r - snt * sna) / det
        if c_n < 0 or c_a < 0:
            # Non-negative least squares in two variables: the better of the
            # two one-variable fits.
            only_n = (max(0.0, snt / snn_r), 0.0)
            only_a = (0.0, max(0.0, sat / saa_r)) if saa_r > 0 else only_n
            c_n, c_a = min((only_n, only_a), key=self._residual)
        if c_n <= 0 and c_a <= 0:
            return None
        return c_n / self._N_UNIT, c_a / self._A_UNIT

    def _residual(self, coef: tuple[float, float]) -> float:
        """Weighted squared error of ``coef`` (in fitting units), up to a constant."""
        c_n, c_a = coef
        return (c_n * c_n * self._snn + 2 * c_n * c_a * self._sna + c_a * c_a * self._saa
                - 2 * (c_n * self._snt + c_a * self._sat))

    def _predict(self, num_tokens: int, attn_pairs: float) -> float:
        assert self._coef is not None
        c_tok, c_attn = self._coef
        return c_tok * num_tokens + c_attn * attn_pairs

    @property
    def ready(self) -> bool:
        return self._coef is not None

    @property
    def coefficients(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per attention pair), once fitted."""
        return self._coef

    def compute_s(self, start: int, num_tokens: int) -> float | None:
        """Seconds to compute tokens [start, start + num_tokens), or None (cold)."""
        if self._coef is None:
            return None
        return self._predict(num_tokens, attention_pairs(num_tokens, start))

    def tokens_per_s(self, num_tokens: int = 1024) -> float | None:
        """Prefill rate of a ``num_tokens``-token prompt without context."""
        seconds = self.compute_s(0, num_tokens)
        if seconds is None or seconds <= 0:
            return None
        return num_tokens / seconds

    def reset(self) -> None:
        """Forget every sample (the settings stay)."""
        self.samples = 0
        self._snn = self._sna = self._saa = self._snt = self._sat = 0.0
        self._coef = None


class LoadDecider:
    """Per hit: load it, or let vLLM recompute it (see module doc)."""

    def __init__(self, mode: str, page_bytes: int, margin: float = LOAD_MARGIN,
                 clock: Callable[[], float] = time.monotonic,
                 probe_interval_s: float = PROBE_INTERVAL_S,
                 l3_probe_interval_s: float = L3_PROBE_INTERVAL_S) -> None:
        if mode not in LOAD_DECISIONS:
            raise ValueError(f"unknown hicache_load_decision {mode!r}; "
                             f"accepted: {', '.join(LOAD_DECISIONS)}")
        self.mode = mode
        self.page_bytes = page_bytes
        self.margin = margin
        self.clock = clock
        self._probe_interval_s = {"L2": probe_interval_s, "L3": l3_probe_interval_s}
        self.l2 = BandwidthEstimate()   # L2 -> L1 loads
        self.l3 = BandwidthEstimate()   # L3 -> L2 prefetches
        self.prefill = PrefillModel()
        self._l3_latency_s: deque[float] = deque(maxlen=BANDWIDTH_WINDOW)
        # When each tier's estimate last got a sample (or a probe was let through).
        self._refreshed = {"L2": clock(), "L3": clock()}

    @property
    def auto(self) -> bool:
        return self.mode == LoadDecision.AUTO

    def observe_transfers(self, load: tuple[float, float] = (0.0, 0.0),
                          prefetch: tuple[float, float] = (0.0, 0.0)) -> None:
        """One step's (bytes, seconds) of L2 -> L1 loads and L3 -> L2 prefetches."""
        if self.l2.observe(*load):
            self._refreshed["L2"] = self.clock()
        if self.l3.observe(*prefetch):
            self._refreshed["L3"] = self.clock()

    def observe_l3_latency(self, seconds: float) -> None:
        """One L3 lookup's round trip, in seconds."""
        if 0.0 <= seconds <= MAX_STEP_S:
            self._l3_latency_s.append(seconds)

    def l3_latency_s(self) -> float:
        """Median recent L3 round trip; 0 before any was measured."""
        if not self._l3_latency_s:
            return 0.0
        ordered = sorted(self._l3_latency_s)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def observe_step(self, num_tokens: int, attn_pairs: float, seconds: float) -> None:
        self.prefill.observe(num_tokens, attn_pairs, seconds)

    def _transfer_s(self, estimate: BandwidthEstimate, num_pages: int) -> float | None:
        rate = estimate.bytes_per_s()
        if rate is None or rate <= 0:
            return None
        return num_pages * self.page_bytes / rate

    def _worth(self, load_s: float | None, start: int, num_tokens: int) -> bool:
        compute_s = self.prefill.compute_s(start, num_tokens)
        if load_s is None or compute_s is None:
            return True  # cold start: load
        return load_s <= (1.0 + self.margin) * compute_s

    def load_l2(self, start: int, num_tokens: int, num_pages: int) -> bool:
        """Load an L2 hit of ``num_tokens`` tokens (``num_pages`` pages) after
        ``start`` cached tokens?"""
        if not self.auto or num_pages <= 0:
            return True
        if self._worth(self._transfer_s(self.l2, num_pages), start, num_tokens):
            return True
        return self._stale("L2")

    def wants_l3_sample(self) -> bool:
        """Has the L3 estimate gone stale? (True once per interval.)"""
        return self.auto and self.l3.ready and self._stale("L3")

    def _stale(self, tier: str) -> bool:
        now = self.clock()
        if now - self._refreshed[tier] >= self._probe_interval_s[tier]:
            self._refreshed[tier] = now  # one probe per interval, not a burst
            return True
        return False

    def prefetch_l3(self, start: int, num_tokens: int, num_pages: int) -> bool:
        """Wait for an L3 hit of ``num_tokens`` tokens to be prefetched (and
        then loaded), rather than compute it?"""
        if not self.auto or num_pages <= 0:
            return True
        fetch_s = self._transfer_s(self.l3, num_pages)
        if fetch_s is not None:
            fetch_s += self._transfer_s(self.l2, num_pages) or 0.0
            fetch_s += self.l3_latency_s()
        return self._worth(fetch_s, start, num_tokens)

    def estimates(self) -> dict[str, float]:
        """Current estimates (absent while cold): ``L2``/``L3`` bytes per
        second, ``prefill`` tokens per second."""
        out: dict[str, float] = {}
        for tier, est in (("L2", self.l2), ("L3", self.l3)):
            rate = est.bytes_per_s()
            if rate is not None:
                out[tier] = rate
        rate = self.prefill.tokens_per_s()
        if rate is not None:
            out["prefill"] = rate
        return out
