"""Process facts every layer needs (and nothing else)."""

from __future__ import annotations

import os

#: The largest pid Linux can hand out (PID_MAX_LIMIT on 64-bit kernels).
PID_MAX = 1 << 22


def valid_pid(pid: object) -> bool:
    """A pid a live process could have: an int in 1..PID_MAX (bool excluded)."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= PID_MAX


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (ours or not). A pid no process can have
    (<= 0, or above PID_MAX) is never alive: 0 and -1 would signal whole process groups."""
    if not valid_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
