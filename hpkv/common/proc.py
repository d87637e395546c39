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


def pid_running(pid: int) -> bool:
    """:func:`pid_alive`, but a zombie (exited, not yet reaped: e.g. a vLLM worker SIGKILLed by
    its engine's shutdown whose parent has not waited for it) counts as gone."""
    if not pid_alive(pid):
        return False
    return _state(pid) not in (b"Z", b"X")  # unknown (b""): alive as far as we know


def pid_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, or a tracer): it would not act on a SIGTERM."""
    return _state(pid) in (b"T", b"t")


def _state(pid: int) -> bytes:
    """The process's state letter from /proc (b"" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return b""
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'
    return stat_line[stat_line.rfind(b")") + 2 : stat_line.rfind(b")") + 3]


MMAP_THRESHOLD = 64 << 10  # malloc blocks from this size up are mapped alone, unmapped when freed
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
_M_ARENA_MAX = -8


def unmap_big_frees() -> bool:
    """Keep the server's malloc heap to what it holds. glibc raises its mmap threshold to the
    size of any mapped block freed (up to 32 MiB), after which big temporary arrays (numpy's,
    a scan's batches) land in the heap and leave it holed; here every block of
    :data:`MMAP_THRESHOLD` bytes or more is mapped on its own and unmapped when freed. And one
    arena for all threads: the server's threads run Python under one lock, so more arenas only
    keep more freed memory resident (a scan thread's, the stat threads'). Measured in the
    server after a scan of 10^4 blocks (``hpkv bench scale``): 264-276 B per block with the
    defaults, 236-250 with one arena, 165-173 with both and :func:`trim_heap` after the scan's
    journal records. Returns False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, 1)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def trim_heap() -> None:
    """Give the free pages inside malloc's heap back to the system (``malloc_trim``), after a
    burst of temporary allocations such as a scan's; a no-op without glibc."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
