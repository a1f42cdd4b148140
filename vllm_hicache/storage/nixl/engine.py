"""One NIXL agent with one storage plugin: DRAM <-> FILE/OBJ transfers with a deadline.

A *job* moves one object: local DRAM spans and remote (FILE or OBJ) descriptors,
pairwise, plus a ``finish(ok) -> bool`` callback that releases the job's
resources and turns the transfer's outcome into the key's result.

Invariant: ``finish`` runs exactly once, after NIXL said DONE or ERR (ERR of a
multi-job request: slots retired). NIXL cannot cancel a running transfer:
releasing an in-progress handle frees the plugin's request while queued AIO
or S3 callbacks still reference it. So a transfer that misses its deadline is
*parked* (handle, registrations and buffers kept alive) and reported as a
miss; later calls reap it once NIXL says DONE or ERR. Jobs use staging slots
only (staging.py), so a parked transfer never touches caller memory.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_hicache.storage.buffers import address

logger = logging.getLogger(__name__)

INSTALL = ("pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 "
           "(nixl-cu13==1.5.1 where CUDA 13 is installed)")
# libaio copies buffered data inside the poll that submits the next 64 I/Os: a
# slow poll did work, and the next follows at once. A poll that returns at once
# found nothing: back off from 10 us, doubling, to 1 ms (a hung store costs no core).
_BUSY_POLL_S = 50e-6
_MAX_POLL_SLEEP_S = 1e-3
_CLOSE_WAIT_S = 2.0  # close() waits this long for parked transfers, then leaks them


class _SharedReg:
    """One registration used by several jobs: deregistered when the last one finishes."""

    def __init__(self, agent: Any, reg: Any, users: int) -> None:
        self.agent, self.reg, self.users = agent, reg, users
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                self.agent.deregister_memory(self.reg)


@dataclass(slots=True, eq=False)
class Job:
    # (address, nbytes) of local DRAM spans, in object order.
    local: list[tuple[int, int]]
    # (offset, nbytes, dev_id) remote descriptors, pairwise with ``local``.
    remote: list[tuple[int, int, int]]
    # Releases the job's resources; ok = the transfer completed. Returns the key's result.
    finish: Callable[[bool], bool]
    # The staging slot the transfer uses: it lives until ``finish``.
    keep: Any = None
    # The call's DRAM registration of spans outside the registered regions.
    dram_reg: _SharedReg | None = None
    done: bool = False


def import_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as err:
        raise ImportError(f"the nixl L3 backend needs NIXL: {INSTALL} ({err})") from err
    return _api


class NixlEngine:
    """A NIXL agent plus the bookkeeping that makes its transfers safe to share."""

    def __init__(self, agent_name: str, plugin: str, params: dict[str, str],
                 remote_mem: str) -> None:
        api = import_nixl()
        # RW: transfers take the agent's lock shared, registrations exclusive;
        # the default without a listener thread is no locking at all.
        conf = api.nixl_agent_config(
            enable_prog_thread=False, backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self.agent = api.nixl_agent(agent_name, conf)
        if plugin not in self.agent.get_plugin_list():
            raise ValueError(f"nixl backend: plugin {plugin!r} is not in this NIXL build "
                             f"(available: {self.agent.get_plugin_list()})")
        self.agent.create_backend(plugin, params)
        self.name = agent_name
        self.remote_mem = remote_mem
        self._regions: list[tuple[int, int, Any]] = []  # (start, end, registration)
        self._fds: dict[int, Any] = {}  # fd number -> its FILE registration
        self._parked: list[tuple[Any, list[Job]]] = []  # (request, its jobs)
        self._lock = threading.Lock()
        self._dev_ids = itertools.count(1)
        self.num_timeouts = 0
        self.retire: Callable[[Any], None] | None = None  # StagingSlots.retire

    def register_region(self, region: np.ndarray) -> None:
        start = address(region)
        reg = self.agent.register_memory([(start, region.nbytes, 0, "")], "DRAM")
        with self._lock:
            self._regions.append((start, start + region.nbytes, reg))

    def register_remote(self, descs: list[tuple[int, int, int, str]]) -> Any:
        return self.agent.register_memory(descs, self.remote_mem)

    def register_fd(self, fd: int) -> None:
        """Make ``fd`` usable in FILE descriptors. The POSIX plugin keeps nothing per
        FILE registration and the OS reuses fd numbers: registered until close()."""
        with self._lock:
            if fd in self._fds:
                return
            self._fds[fd] = self.agent.register_memory([(0, 0, fd, "")], "FILE")

    def deregister(self, reg: Any) -> None:
        self.agent.deregister_memory(reg)

    def next_dev_id(self) -> int:
        return next(self._dev_ids)

    def _register_local(self, jobs: Sequence[Job]) -> list[Job]:
        """Register the spans outside the registered regions, in one call; the jobs that can run."""
        (s0, e0), *more = [(s, e) for s, e, _ in self._regions] or [(0, 0)]
        outside, users = [], []
        for job in jobs:
            mine = [(a, n, 0, "") for a, n in job.local if not s0 <= a <= e0 - n
                    and not any(s <= a <= e - n for s, e in more)]
            if mine:
                outside += mine
                users.append(job)
        if not users:
            return list(jobs)
        try:
            shared = _SharedReg(self.agent, self.agent.register_memory(outside, "DRAM"), len(users))
        except Exception:  # noqa: BLE001 - a failed registration is a miss for its keys
            logger.debug("nixl: DRAM registration failed", exc_info=True)
            for job in users:
                self._finish(job, False)
            return [job for job in jobs if job not in users]  # Job: eq=False, by identity
        for job in users:
            job.dram_reg = shared
        return list(jobs)

    # --- transfers ---------------------------------------------------------

    def transfer(self, op: str, jobs: Sequence[Job], timeout_s: float, batch: bool) -> list[bool]:
        """Run ``jobs`` ("READ": remote -> DRAM, "WRITE": DRAM -> remote); per-job results.
        ``batch``: one NIXL request for all, re-run one by one if it fails (one bad
        object costs only its own key); else one request per job."""
        self.reap()
        deadline = time.monotonic() + timeout_s
        ready = self._register_local(jobs)
        if batch and len(ready) > 1:
            retry = self._run(op, [ready], deadline, finish_failed=False)
            self._run(op, [[job] for job in retry], deadline, finish_failed=True)
        else:
            self._run(op, [[job] for job in ready], deadline, finish_failed=True)
        return [job.done for job in jobs]

    def _run(self, op: str, groups: list[list[Job]], deadline: float,
             finish_failed: bool) -> list[Job]:
        """Post every group, wait for all until ``deadline``, park those still running.
        Returns the jobs of failed groups (finished as failures if ``finish_failed``)."""
        pending, failed = [], []
        for group in groups:
            handle = self._post(op, group)
            if handle is None:
                failed.extend(group)
            else:
                pending.append((handle, group))
        idle_polls = 0
        while pending:
            start = time.monotonic()
            still = self._sweep(pending, failed)
            now = time.monotonic()
            if still and now >= deadline:
                self._park(still)
                break
            busy = len(still) < len(pending) or now - start > _BUSY_POLL_S
            idle_polls = 0 if busy else idle_polls + 1
            pending = still
            if pending and idle_polls:
                time.sleep(min(_MAX_POLL_SLEEP_S, 1e-5 * 2 ** min(idle_polls - 1, 10)))
        if finish_failed:
            for job in failed:
                self._finish(job, False)
        return [] if finish_failed else failed

    def _sweep(self, pending: list[tuple[Any, list[Job]]], failed: list[Job]):
        """Check each request once; release the ended ones. Returns those still running."""
        still = []
        for handle, group in pending:
            state = self._state(handle)
            if state == "PROC":
                still.append((handle, group))
                continue
            self._release(handle)
            if state == "DONE":
                for job in group:
                    self._finish(job, True)
            else:
                failed.extend(self._retire(group))
        return still

    def _retire(self, group: list[Job]) -> list[Job]:
        """A request of several I/Os can say ERR while others still run (NIXL does not
        wait for them): its jobs' staging slots are never reused."""
        if len(group) > 1 and self.retire is not None:
            for job in group:
                self.retire(job.keep)
        return group

    def _post(self, op: str, group: list[Job]) -> Any:
        # Nx3 arrays: NIXL converts them ~50x faster than lists of tuples.
        local = np.array([(a, n, 0) for job in group for a, n in job.local], np.uint64)
        remote = np.array([d for job in group for d in job.remote], np.uint64)
        try:
            handle = self.agent.initialize_xfer(
                op, self.agent.get_xfer_descs(local, "DRAM"),
                self.agent.get_xfer_descs(remote, self.remote_mem), self.name)
        except Exception:  # noqa: BLE001 - NIXL raises its own error types
            logger.debug("nixl: initialize_xfer failed", exc_info=True)
            return None
        try:
            self.agent.transfer(handle)
        except Exception:  # noqa: BLE001 - the request's state then says ERR
            logger.debug("nixl: transfer post failed", exc_info=True)
        return handle

    def _state(self, handle: Any) -> str:
        try:
            return self.agent.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 - an I/O error is raised, not returned as "ERR"
            logger.debug("nixl: transfer failed", exc_info=True)
            return "ERR"

    def _release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - the request has ended: nothing touches its memory
            logger.warning("nixl: releasing an ended transfer failed", exc_info=True)

    def _finish(self, job: Job, ok: bool) -> None:
        try:
            shared = job.dram_reg
            if shared is not None:
                job.dram_reg = None
                shared.release()
            job.done = bool(job.finish(ok))
        except Exception:  # noqa: BLE001 - a failed commit is this key's miss
            logger.debug("nixl: finishing a job failed", exc_info=True)
            job.done = False

    # --- transfers past their deadline --------------------------------------

    def _park(self, pending: list[tuple[Any, list[Job]]]) -> None:
        with self._lock:
            self._parked.extend(pending)
            self.num_timeouts += len(pending)
        logger.warning("nixl: %d transfer(s) missed their deadline; %d parked until they end",
                       len(pending), self.num_parked)

    def reap(self) -> None:
        """Release parked transfers that have ended (their keys stay misses)."""
        with self._lock:
            parked, self._parked = self._parked, []
        still = []
        for handle, group in parked:
            state = self._state(handle)
            if state == "PROC":
                still.append((handle, group))
                continue
            self._release(handle)
            for job in group if state == "DONE" else self._retire(group):
                self._finish(job, False)
        with self._lock:
            self._parked.extend(still)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def close(self) -> None:
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while self.num_parked and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)
        if self.num_parked:
            logger.warning("nixl: %d transfer(s) still running at close; leaking their "
                           "buffers and descriptors", self.num_parked)
            return
        with self._lock:
            regs = [reg for _, _, reg in self._regions] + list(self._fds.values())
            self._regions, self._fds = [], {}
        for reg in regs:
            self.deregister(reg)
