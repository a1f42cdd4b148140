"""Engine-test fixtures. The reference run (no connector) comes first: vLLM
keeps the worker-side connector in a process-wide global, so an engine
without a connector must not start while one with a connector is alive."""

import pytest

from tests.e2e.engine_utils import close, generate, make_llm, prompts_with_shared_prefix


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Greedy outputs of prompts_with_shared_prefix() without HiCache."""
    llm = make_llm(tiny_model_dir, connector=False)
    try:
        outputs, _ = generate(llm, prompts_with_shared_prefix())
    finally:
        close(llm)
    return outputs
