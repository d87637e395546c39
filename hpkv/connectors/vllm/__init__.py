"""hpkv as a vLLM V1 KV connector, split as vLLM's own offloading connector is: the facade
vLLM loads (:mod:`.connector`), the scheduler side (:mod:`.scheduler`), the worker side
(:mod:`.worker`), the step metadata and stats (:mod:`.metadata`), the namespace and KV
cache description (:mod:`.layout`), and the plugin that registers the name (:mod:`.plugin`).

``kv_connector_module_path: hpkv.connectors.vllm`` keeps working: the class is exported here.
"""

from hpkv.connectors.vllm.connector import HpkvConnectorV1

__all__ = ["HpkvConnectorV1"]
