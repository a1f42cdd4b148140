"""Where this package's log records go when vLLM runs it (see
``log_through_vllm``). A module of its own, below everything that logs, so
the connector need not import the package root above it."""

import logging

_PACKAGE = "vllm_hicache"


def log_through_vllm() -> None:
    """Print this package's log records with vLLM's handler (its format and level).

    vLLM configures only its own ``vllm`` logger (which does not propagate).
    Under ``vllm serve`` the root logger has no handler, so records of other
    packages fall through to Python's last resort: warnings printed bare,
    INFO (the connector's start line) dropped. Done only while the root
    logger has no handler, so an application or test that set up logging
    keeps receiving our records there, once. Idempotent.
    """
    ours = logging.getLogger(_PACKAGE)
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
