"""The ring descriptor, as Python sees it.

The layout and the kinds are defined once, in ``native/ring.h``
(``struct hpkv_desc``, ``enum hpkv_desc_kind``); this module only mirrors them:
:class:`Kind` reads its values from the compiled module, :data:`DESC_DTYPE` is
the numpy view used by batch push/pop, and both are checked against the C
layout at import so a drift fails loudly instead of corrupting rings.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from hpkv.common.native import ffi

N_ARGS = 6

#: numpy view of ``hpkv_desc`` (64 bytes): batch push/pop read and write arrays of it.
DESC_DTYPE = np.dtype(
    {
        "names": ["kind", "flags", "status", "seq", "arg"],
        "formats": ["<u2", "<u2", "<i4", "<u8", ("<u8", (N_ARGS,))],
        "offsets": [0, 2, 4, 8, 16],
        "itemsize": 64,
    }
)


def _check_layout() -> None:
    size = ffi.sizeof("hpkv_desc")
    if DESC_DTYPE.itemsize != size:
        raise ImportError(
            f"hpkv_desc is {size} bytes in the native core, "
            f"{DESC_DTYPE.itemsize} in hpkv.ring.desc: rebuild native/ (pip install -e .)"
        )
    fields: Mapping[str, Any] = DESC_DTYPE.fields or {}
    for name in fields:
        if fields[name][1] != ffi.offsetof("hpkv_desc", name):
            raise ImportError(
                f"hpkv_desc.{name} is at offset {ffi.offsetof('hpkv_desc', name)} in the "
                f"native core, {fields[name][1]} in hpkv.ring.desc"
            )


_check_layout()

# enum hpkv_desc_kind, read from the compiled module: HPKV_DESC_COPY_SAVE -> Kind.COPY_SAVE.
_KIND_VALUES = {
    name[len("HPKV_DESC_") :]: value
    for name, value in ffi.typeof("enum hpkv_desc_kind").relements.items()
    if name != "HPKV_DESC_KIND_COUNT"
}
Kind = enum.IntEnum("Kind", _KIND_VALUES, module=__name__)  # type: ignore[misc]  # members from C
Kind.__doc__ = "Descriptor kinds (``enum hpkv_desc_kind`` in native/ring.h)."


class Desc(NamedTuple):
    """One descriptor popped from a ring (flat: native/python/ringcall.c builds it as one tuple)."""

    kind: int
    flags: int
    status: int
    seq: int
    a0: int = 0
    a1: int = 0
    a2: int = 0
    a3: int = 0
    a4: int = 0
    a5: int = 0

    @property
    def args(self) -> tuple[int, int, int, int, int, int]:
        return self[4:]


def new_descs(n: int) -> np.ndarray:
    """A zeroed array of ``n`` descriptors, ready for push_batch / pop_batch."""
    return np.zeros(n, dtype=DESC_DTYPE)
