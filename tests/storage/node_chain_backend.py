"""A NodeChainBackend that ``create_backend("dynamic", ...)`` can build from
options alone, so the conformance suite (which builds backends by spec, also
in a second process) runs on it. Options: ``root`` (the tmpfs directory),
``remote_path`` (a file backend behind the node tier; absent: none)."""

from __future__ import annotations

from vllm_hicache.node import NodeTier
from vllm_hicache.storage import create_backend
from vllm_hicache.storage.node_chain import NodeChainBackend

SLOTS = 256


class NodeChainForTests(NodeChainBackend):
    def __init__(self, options, ctx) -> None:
        options = dict(options)
        root = options.pop("root")
        remote_path = options.pop("remote_path", None)
        if options:
            raise ValueError(f"unknown options {sorted(options)}")
        remote = create_backend("file", {"path": remote_path}, ctx) if remote_path else None
        tier = NodeTier.join("test", "conformance", SLOTS * ctx.object_bytes,
                             ctx.object_bytes, root=root)
        super().__init__({}, ctx, tier=tier, remote=remote)
