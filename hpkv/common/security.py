"""The security model's file-system and socket half (see docs/security.md).

One server per user. Its directories (the pool directory, the storage root and
every directory under it) are created 0700 whatever the umask, and an existing
one is refused when it is a symlink, is owned by another user, or is writable by
its group or by others: such a directory lets another local user swap the socket,
plant KV files or read them. The storage root's ancestors are checked too
(:func:`check_ancestors`): a private directory in one that others can write can be
renamed away. Files inside are opened relative to a verified directory descriptor with
O_NOFOLLOW, so a planted symlink is never followed.
Peers on the server's socket are checked with SO_PEERCRED: same uid, or a member
of the group named by ``HPKV_ALLOW_GROUP``.
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import stat
import struct

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class InsecurePath(PermissionError):
    """A directory hpkv would trust is not private to this user; the message says what to do."""


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def check_private(st: os.stat_result, path: str, what: str) -> None:
    """Refuse a directory that is not ours or that others may write (raises :class:`InsecurePath`)."""
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise InsecurePath(
            errno.ENOTDIR,
            f"{what} {path} is not a directory (a symlink or a file): remove it or choose another path",
        )
    if st.st_uid != me:
        raise InsecurePath(
            errno.EPERM,
            f"{what} {path} is owned by {_owner_name(st.st_uid)}, not by "
            f"{_owner_name(me)} who runs hpkv: another local user could read or inject "
            f"KV through it. Have its owner (or root) remove it, or choose another path",
        )
    if st.st_mode & 0o022:
        raise InsecurePath(
            errno.EPERM,
            f"{what} {path} is writable by its group or by others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): another local user could swap or plant "
            f"files in it. Run `chmod go-w {path}` (hpkv creates it 0700) or choose "
            f"another path",
        )


def check_ancestors(path: str, what: str, missing_ok: bool = False) -> None:
    """Refuse ``path`` if a directory above it lets another user rename it away (raises
    :class:`InsecurePath`): every ancestor (and every symlink on the way) must be owned by
    root or by us, and an ancestor writable by its group or others must be sticky (/tmp).
    ``missing_ok``: ancestors that do not exist yet are skipped (hpkv would create them 0700),
    so the question can be asked before anything is created (``hpkv doctor``).

    Why: a private directory in a directory another user can write is private only until
    that user renames it and puts their own tree in its place."""
    me = os.geteuid()
    path = os.path.abspath(path)
    seen: set[str] = set()
    todo = [path, os.path.realpath(path)]
    while todo:
        p = todo.pop()
        while (parent := os.path.dirname(p)) != p:
            p = parent
            if p in seen:
                continue
            seen.add(p)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                if missing_ok:
                    continue
                raise
            if stat.S_ISLNK(st.st_mode):
                todo.append(os.path.realpath(p))  # the link's target's ancestors count too
            problem = None
            if st.st_uid not in (0, me):
                problem = f"owned by {_owner_name(st.st_uid)}"
            elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX and not stat.S_ISLNK(st.st_mode):
                mode = stat.S_IMODE(st.st_mode)
                problem = f"writable by its group or by others without the sticky bit (mode {mode:04o})"
            if problem:
                raise InsecurePath(
                    errno.EPERM,
                    f"{what} {path} is inside {p}, which is {problem}: another local user could "
                    f"rename {path} away and put their own files in its place. Run `chmod go-w {p}` "
                    f"(or have root own it), or choose a path whose every parent directory is owned "
                    f"by root or {_owner_name(me)} and not writable by others (sticky like /tmp is fine)",
                )


def makedirs_private(path: str) -> None:
    """``mkdir -p`` with every directory it creates 0700, whatever the umask."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # another process made it: checked by the caller if it matters
        os.chmod(d, PRIVATE_DIR_MODE, follow_symlinks=False)  # the umask may have taken bits


def ensure_private_dir(path: str, what: str) -> None:
    """Create ``path`` 0700 if missing, then refuse it unless it is private (no symlink, ours,
    not group/other-writable)."""
    makedirs_private(path)
    check_private(os.lstat(path), path, what)


def open_private_dir(path: str, what: str) -> int:
    """A descriptor of ``path``, created 0700 if missing and verified private through the
    descriptor itself (so a swap after the check cannot fool us). The caller closes it."""
    makedirs_private(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_private(os.fstat(fd), path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_nofollow(dir_fd: int, name: str, flags: int, mode: int = PRIVATE_FILE_MODE) -> int:
    """Open ``name`` inside a verified directory, never through a symlink (ELOOP if it is one)."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


# ------------------------------------------------------------------ peers
_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as of its connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def _supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def peer_allowed(pid: int, uid: int, gid: int, allow_group: int | None) -> bool:
    """Same uid as this process, or (``allow_group`` set) a member of that group."""
    if uid == os.geteuid():
        return True
    if allow_group is None:
        return False
    return gid == allow_group or allow_group in _supplementary_groups(pid)
