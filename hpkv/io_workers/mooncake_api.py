"""The one place that imports Mooncake Store (the optional ``mooncake`` extra).

:func:`store_class` imports ``mooncake.store`` and probes that the calls hpkv uses exist, with
an error that says what to install when they do not. Everything else (the remote worker, the
bench, the tests) goes through it, so the tested version and the probe are stated once.

Mooncake's return codes are its ``ErrorCode`` values (``mooncake-store/include/types.h``); the
ones hpkv acts on are named in :data:`ERRORS`.
"""

from __future__ import annotations

import errno
import importlib
import importlib.metadata
import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpkv.protocol.keys import FORMAT_VERSION

if TYPE_CHECKING:
    from hpkv.io_workers.kvfile import BlockId

DISTRIBUTION = "mooncake-transfer-engine-non-cuda"
TESTED_VERSION = "0.3.13.post1"
INSTALL_HINT = (
    f"pip install 'hpkv[mooncake]' (pins {DISTRIBUTION}=={TESTED_VERSION}); its native library also needs "
    "the Debian/Ubuntu package libibverbs1 (apt-get install libibverbs1), even for TCP"
)

# The calls hpkv makes; a build without one of them is refused at start, not at the first use.
REQUIRED = (
    "setup",
    "register_buffer",
    "unregister_buffer",
    "batch_put_from",
    "batch_get_into",
    "batch_is_exist",
    "batch_put_from_multi_buffers",
    "batch_get_into_multi_buffers",
    "remove",
    "close",
)

ERRORS = {
    -200: "NO_AVAILABLE_HANDLE (no segment has room)",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (master unreachable)",
}
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900


NO_AVAILABLE_HANDLE = -200


def errno_of(code: int) -> int:
    """The errno a failed call answers the server with: ETIMEDOUT when the master did not
    answer (its RPC failed: the server marks the tier down at once), ENOSPC when no segment
    had room (full, or none mounted yet: for a moment after a master restart, until the
    clients' segments are mounted again; not a failure of the store), EIO otherwise."""
    return {RPC_FAIL: errno.ETIMEDOUT, NO_AVAILABLE_HANDLE: errno.ENOSPC}.get(code, errno.EIO)


class MooncakeUnavailable(RuntimeError):
    """Mooncake Store cannot be used here; the message says why and what to install."""


def describe(code: int) -> str:
    return f"{code} {ERRORS.get(code, 'error')}"


def object_key(block: BlockId) -> str:
    """The store's name of one rank's shard: the format version in it keeps objects of another
    format from ever matching (their header would be refused anyway)."""
    return f"hpkv{FORMAT_VERSION}/{block.namespace.hex()}/{block.key.hex()}/r{block.rank}"


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, after checking that it imports and has every
    call in :data:`REQUIRED`; raises :class:`MooncakeUnavailable` otherwise."""
    try:
        mod = importlib.import_module("mooncake.store")
    except ModuleNotFoundError as e:
        raise MooncakeUnavailable(f"Mooncake Store is not installed ({e}); {INSTALL_HINT}") from e
    except ImportError as e:
        if "libibverbs" in str(e):
            raise MooncakeUnavailable(
                f"Mooncake Store is installed but cannot load: {e}. Install the system library: "
                "apt-get install libibverbs1"
            ) from e
        raise MooncakeUnavailable(f"Mooncake Store cannot be imported: {e}; {INSTALL_HINT}") from e
    cls = getattr(mod, "MooncakeDistributedStore", None)
    missing = [m for m in REQUIRED if cls is None or not callable(getattr(cls, m, None))]
    if missing:
        raise MooncakeUnavailable(
            f"the installed Mooncake ({DISTRIBUTION} {installed_version() or 'unknown version'}) lacks "
            f"{', '.join(missing)}; hpkv is tested with {TESTED_VERSION}: {INSTALL_HINT}"
        )
    return cls


def master_binary() -> str:
    """The ``mooncake_master`` executable that ships inside the wheel (or one on PATH)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin:
        exe = Path(spec.origin).parent / "mooncake_master"
        if exe.is_file():
            return str(exe)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise MooncakeUnavailable(f"mooncake_master not found; {INSTALL_HINT}")


def unavailable() -> str | None:
    """Why Mooncake Store cannot be used here, or None."""
    try:
        store_class()
        master_binary()
    except MooncakeUnavailable as e:
        return str(e)
    return None
