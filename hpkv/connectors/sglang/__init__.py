"""hpkv as SGLang's HiCache storage tier (L3), for SGLang 0.5.23.

SGLang loads :class:`HpkvHiCacheStorage` through its ``dynamic`` storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"hpkv","module_path":"hpkv.connectors.sglang",
        "class_name":"HpkvHiCacheStorage","interface_v1":1,"allocator":"shm"}'

or, with hpkv's SGLang plugin (an ``sglang.srt.plugins`` entry point), simply
``--enable-ct-hpkv`` (see :mod:`hpkv.connectors.sglang.plugin`). Importing this package
imports neither SGLang nor torch: the plugin loads it in every SGLang process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HpkvHiCacheStorage", "BACKEND_EXTRA_CONFIG"]

#: The extra config ``--enable-ct-hpkv`` passes to ``--hicache-storage-backend dynamic``.
#: ``allocator: shm`` makes SGLang allocate its host pool in a memfd that hpkv's transfer
#: worker maps (zero-copy saves and loads); ``interface_v1`` selects batch_get_v1/batch_set_v1.
BACKEND_EXTRA_CONFIG: dict[str, Any] = {
    "backend_name": "hpkv",
    "module_path": "hpkv.connectors.sglang",
    "class_name": "HpkvHiCacheStorage",
    "interface_v1": 1,
    "allocator": "shm",
}


def __getattr__(name: str) -> Any:
    if name == "HpkvHiCacheStorage":  # imports SGLang: only when SGLang asks for the class
        from hpkv.connectors.sglang.storage import HpkvHiCacheStorage

        return HpkvHiCacheStorage
    raise AttributeError(name)
