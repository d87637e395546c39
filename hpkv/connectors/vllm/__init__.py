"""hpkv as a vLLM V1 KV connector, split as vLLM's own offloading connector is: the facade
vLLM loads (:mod:`.connector`), the scheduler side (:mod:`.scheduler`), the worker side
(:mod:`.worker`), the step metadata and stats (:mod:`.metadata`), the namespace and KV
cache description (:mod:`.layout`), and the plugin that registers the name (:mod:`.plugin`).

``kv_connector_module_path: hpkv.connectors.vllm`` keeps working: the class is exported here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HpkvConnectorV1"]


def __getattr__(name: str) -> Any:
    # Lazy, so that the layout code (cuda_layout) imports on machines without vLLM (the device check).
    if name == "HpkvConnectorV1":
        from hpkv.connectors.vllm.connector import HpkvConnectorV1

        return HpkvConnectorV1
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
