"""IO priority of background work: hpkv's write-through must never slow the engine.

Linux only; every call degrades to a no-op (with the reason) where the kernel or the
sandbox refuses it. Lowering a BE IO priority and raising it back within the BE class
needs no privilege, so an IO worker can switch per job: spills at the lowest best-effort
level, promotes (a request waits for them) at the default.
"""

from __future__ import annotations

import ctypes
import os
import platform

IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_BE = 2
IOPRIO_WHO_PROCESS = 1
BE_DEFAULT = 4
BE_LOWEST = 7
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


def set_io_priority(level: int) -> str | None:
    """Best-effort IO priority ``level`` (0 highest .. 7 lowest) for this thread; None when set,
    else why not."""
    if _SYS_IOPRIO_SET is None:
        return f"ioprio_set unknown on {platform.machine()}"
    value = IOPRIO_CLASS_BE << IOPRIO_CLASS_SHIFT | level
    if _libc.syscall(_SYS_IOPRIO_SET, IOPRIO_WHO_PROCESS, 0, value) != 0:
        return f"ioprio_set: {os.strerror(ctypes.get_errno())}"
    return None
