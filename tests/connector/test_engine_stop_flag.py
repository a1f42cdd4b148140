"""vllm_compat.engine_stop_flag and shutdown_timeout_s against vLLM 0.32's
own EngineCoreProc and VllmConfig: the flag follows ``shutdown_state`` as
vLLM's signal handler sets it, and is None outside an EngineCoreProc."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import VllmConfig
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

from vllm_hicache.connector.vllm_compat import engine_stop_flag, shutdown_timeout_s


class _Proc(EngineCoreProc):
    """An EngineCoreProc whose construction only asks for the flag, as the
    connector does while vLLM builds the real one."""

    def __init__(self) -> None:  # noqa: D107 - vLLM's would start an engine
        self.shutdown_state = EngineShutdownState.RUNNING
        self.flag = engine_stop_flag()


def test_the_flag_follows_vllms_shutdown_state():
    proc = _Proc()
    assert proc.flag is not None and not proc.flag()
    proc.shutdown_state = EngineShutdownState.REQUESTED  # what vLLM's SIGTERM handler does
    assert proc.flag()
    proc.shutdown_state = EngineShutdownState.SHUTTING_DOWN
    assert proc.flag()


def test_no_flag_outside_an_engine_core_process():
    assert engine_stop_flag() is None


def test_shutdown_timeout_is_vllms_field():
    assert shutdown_timeout_s(VllmConfig()) == 0
    assert shutdown_timeout_s(VllmConfig(shutdown_timeout=20)) == 20
    assert shutdown_timeout_s(SimpleNamespace()) == 0  # a vLLM without the field
