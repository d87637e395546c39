"""vLLM plugin (entry point ``vllm.general_plugins``): registers ``HpkvConnectorV1`` by name.

With it, CT-HPKV's own command line works without a module path:
``--kv-transfer-config '{"kv_connector":"HpkvConnectorV1","kv_role":"kv_both"}'``.
vLLM may load plugins several times per process, so registering is idempotent.
"""

from __future__ import annotations

CONNECTOR_NAME = "HpkvConnectorV1"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "hpkv.connectors.vllm.connector", CONNECTOR_NAME
        )
