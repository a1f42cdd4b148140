"""Same-step admission of an L3 hit: which prefetch policies use it, and how
long a worker's L1 copy may wait for the read it depends on.

Without it an L3 hit costs a scheduling round trip: step N sends the read,
the workers report it with step N's output, step N+1 admits the request
as an L2 hit. With ``same_step_read_wait_ms`` > 0 a request whose lookup
has answered by the time vLLM offers it a slot is admitted in step N with
its L2 part and its L3 part; each worker reads the L3 part into its L2
pages during step N and copies each page to L1 once it is read, waiting at
most the step's read wait. What is not read by then is a load error: vLLM
recomputes that block and those after it, never uses wrong KV.

Which policies: wait_complete and timeout, the two under which a request
waits for its prefetch anyway; the wait moves from a whole step into the
worker's copy. best_effort promises that a request never waits for L3, so
the option is refused with it (it would do nothing). Under timeout the
read wait is also cut to what is left of the request's own deadline.

Pure module: no torch, no vLLM.
"""

from __future__ import annotations

from vllm_hicache.policy.prefetch import PrefetchPolicyName

# The longest read wait accepted: every request of a step waits with it.
MAX_SAME_STEP_WAIT_MS = 1000.0


def check_same_step_policy(read_wait_ms: float, policy: str) -> None:
    """Refuse ``same_step_read_wait_ms`` where it would do nothing (best_effort)."""
    if read_wait_ms > 0 and policy == PrefetchPolicyName.BEST_EFFORT:
        raise ValueError(
            f"same_step_read_wait_ms={read_wait_ms:g} in hicache_storage_backend_extra_config "
            "needs hicache_storage_prefetch_policy=wait_complete or timeout: under "
            "best_effort a request never waits for L3, so nothing is admitted in the step "
            "its read is sent; remove it or change the policy")


def read_wait_s(read_wait_ms: float, deadline_left_s: float) -> float:
    """How long the L1 copy of a same-step hit may wait for its read: the
    configured wait, cut to what is left of the request's deadline."""
    return max(0.0, min(read_wait_ms / 1000.0, deadline_left_s))
