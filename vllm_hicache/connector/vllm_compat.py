"""Every place where vllm_hicache reaches into vLLM internals (private
attributes, call-stack shape, sentinels), one function each, with what in
vLLM would break it. Anything here must degrade to "feature unavailable",
never to a failed engine: vLLM changes these without notice.

Checked against vLLM 0.32 (``vllm/v1/engine/core.py``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)


def engine_loop_waker() -> Callable[[], None] | None:
    """A callable that wakes this process's idle EngineCore busy loop, or
    None where there is none to wake (an in-process engine, a test harness).

    Why: an idle ``EngineCoreProc`` blocks in ``_process_input_queue`` on
    ``input_queue.get()`` and looks at ``has_work()`` (which includes the
    connector's ``has_pending_push_work``) only when something arrives there.
    The admin API thread (admin_api.py) queues a command for the scheduler
    half, which makes ``has_pending_push_work`` true; this callable then puts
    vLLM's own ``WAKEUP`` sentinel (what its shutdown path uses to wake the
    same loop; ``_handle_client_request`` ignores it) into that queue, so the
    loop re-checks ``has_work()`` and runs a step, in which the command runs.

    How the queue is found: the scheduler half is built while
    ``EngineCoreProc.__init__`` runs (it creates ``input_queue`` before it
    calls ``EngineCore.__init__``, which builds the Scheduler and so this
    connector), so one frame up the stack has ``self`` = that EngineCoreProc.
    Call it from the connector's constructor.

    Breaks if vLLM: builds the scheduler outside EngineCoreProc construction
    (then None: admin commands wait for the next step some request causes);
    renames ``EngineCoreProc``, ``input_queue`` or
    ``EngineCoreRequestType.WAKEUP``; or starts treating WAKEUP as anything
    but a no-op (then None or a wrong wake-up; tests/e2e/test_admin_api.py
    catches both: an idle server must answer admin calls).
    """
    try:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc
        wakeup = EngineCoreRequestType.WAKEUP
    except (ImportError, AttributeError):
        logger.debug("vLLM has no EngineCoreProc/WAKEUP: admin commands run on the next step")
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            queue = getattr(owner, "input_queue", None)
            if queue is None or not hasattr(queue, "put_nowait"):
                return None
            return lambda: queue.put_nowait((wakeup, None))
        frame = frame.f_back
    return None
