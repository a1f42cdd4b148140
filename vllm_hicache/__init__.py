"""vllm_hicache: SGLang's HiCache (hierarchical KV cache) as a vLLM KV connector.

Use with ``kv_connector="HiCacheConnector"``. Installing the package declares
a ``vllm.general_plugins`` entry point (``hicache`` -> :func:`register`) that
registers the connector with vLLM's connector factory, so
``kv_connector_module_path`` is optional (``"vllm_hicache"`` still works, and
is needed where plugins are filtered out with ``VLLM_PLUGINS``). The connector
is imported lazily so that the pure core (index/, policy/, config, keys)
imports without torch or vllm.
"""

import logging

from vllm_hicache.logs import log_through_vllm

__all__ = ["CONNECTOR_NAME", "HiCacheConnector", "register"]
__version__ = "0.1.0"

CONNECTOR_NAME = "HiCacheConnector"
# Where the factory imports the class from, on first use only.
_CONNECTOR_MODULE = "vllm_hicache.connector"

logger = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` hook: register ``HiCacheConnector`` by name.

    vLLM calls it in every process it starts (API server, engine core,
    workers), possibly more than once. The registration is lazy (a module
    path and a class name; nothing heavy is imported here) and idempotent: a
    name already registered, by an earlier call or by anyone else, is left
    as it is.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    log_through_vllm()
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, _CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        # vLLM's factory refuses a second registration of a name.
        logger.debug("%s is already registered with vLLM's connector factory", CONNECTOR_NAME)


def __getattr__(name: str):
    if name == "HiCacheConnector":
        from vllm_hicache.connector import HiCacheConnector

        return HiCacheConnector
    raise AttributeError(f"module 'vllm_hicache' has no attribute {name!r}")
