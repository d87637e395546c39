"""The hpkv client library: what connectors, the CLI and tests use to talk to the server.

``connect()`` (:mod:`.reach`) attaches to the server of the configured pool directory or
starts one (:mod:`.spawn`) and returns an :class:`HpkvClient` (:mod:`.client`), whose
devices' transfer workers a :class:`DeviceHandle` (:mod:`.device`) drives; :mod:`.contract`
types the hot calls; :mod:`.control` stops a server.
"""

from hpkv.client.client import HpkvClient, NamespaceHandle
from hpkv.client.contract import BlockMover, KvStore
from hpkv.client.device import DeviceHandle
from hpkv.client.reach import connect, ensure_server
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
