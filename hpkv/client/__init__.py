"""The hpkv client library: what connectors, the CLI and tests use to talk to the server.

``connect()`` (:mod:`.connection`) attaches to the server of the configured pool directory or
starts one (:mod:`.spawn`); :mod:`.contract` types the hot calls; :mod:`.control` stops a server.
"""

from hpkv.client.connection import DeviceHandle, HpkvClient, NamespaceHandle, connect, ensure_server
from hpkv.client.contract import BlockMover, KvStore
from hpkv.protocol.errors import HpkvError, HpkvUnavailable

__all__ = [
    "BlockMover",
    "DeviceHandle",
    "HpkvClient",
    "HpkvError",
    "HpkvUnavailable",
    "KvStore",
    "NamespaceHandle",
    "connect",
    "ensure_server",
]
