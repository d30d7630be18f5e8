"""vLLM plugin (entry point `vllm.general_plugins`): registers `TieredCacheConnector` by name, so
`"kv_connector": "TieredCacheConnector"` works without `kv_connector_module_path`."""

from __future__ import annotations

NAME = "TieredCacheConnector"


def register() -> None:
    """Called by vLLM in every process it starts; registering twice is harmless."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "tiered_cache.integrations.vllm.connector", NAME)
