"""Process facts every layer needs (and nothing else)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (ours or not); non-positive pids count as alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
