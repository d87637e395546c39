"""The storage tree: every path under the storage root opened relative to a verified
directory descriptor, one component at a time, never through a symlink.

Why: a path string is resolved again by the kernel at every use, so a directory renamed
away or replaced by a symlink after the server checked it would redirect later reads and
writes (a forged KV file promoted, a file outside storage overwritten). Here the root is
held open: the server opens it once, after :func:`hpkv.common.security.check_ancestors`
(no other user can rename it) and :func:`~hpkv.common.security.check_private`; an IO
worker opens it by name and refuses to run unless it is that very directory (device and
inode from the server, :meth:`StorageTree.attach`). Below the root, ``<fingerprint>/<aa>/<bb>``
is walked with ``openat(O_DIRECTORY | O_NOFOLLOW)`` (a directory hpkv makes is made 0700;
others cannot reach below the private root, so the modes below it are not re-checked), and
files are opened, stat-ed, renamed and unlinked relative to their directory's descriptor;
reads open their file with one ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` from the
root where the kernel has it (Linux 5.6+), which refuses the same symlinks in one call.

Directory descriptors are cached: an LRU of at most ``max_dirs`` per tree (the parents of
a leaf are cached too, so a leaf seen for the first time costs one ``openat`` and, when the
LRU is full, one ``close``), each one reopened after :data:`DIR_CACHE_TTL_S` so a directory
renamed or removed from outside is not used for long. A descriptor in use is closed only when its last user is done.
Thread-safe: the server's scan and maintenance threads and a worker's verifier thread
share one tree.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from hpkv.common.native import lib
from hpkv.common.security import (
    PRIVATE_DIR_MODE,
    InsecurePath,
    check_ancestors,
    check_private,
    open_private_dir,
)

DIR_CACHE_MAX = 256  # descriptors per tree: well under the usual limit of 1024 per process
DIR_CACHE_TTL_S = 5.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
WHAT = "the storage directory (HPKV_KV_STORAGE_PATH)"


class _Dir:
    __slots__ = ("fd", "refs", "doomed", "born")

    def __init__(self, fd: int):
        self.fd = fd
        self.refs = 1
        self.doomed = False  # out of the cache: closed when the last user releases it
        self.born = time.monotonic()


class StorageTree:
    """The storage root's descriptor and a bounded cache of the directories below it."""

    beneath = True  # openat2 works here (cleared at the first ENOSYS/EPERM)

    def __init__(self, path: str, root_fd: int, max_dirs: int = DIR_CACHE_MAX):
        self.path = path
        self.root_fd = root_fd
        self.max_dirs = max_dirs
        st = os.fstat(root_fd)
        self.identity = (st.st_dev, st.st_ino)
        self._dirs: OrderedDict[str, _Dir] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str, what: str = WHAT) -> StorageTree:
        """The server's: create ``path`` 0700 if missing, refuse it unless it and its
        ancestors are safe (see the module docstring), hold it open."""
        fd = open_private_dir(path, what)
        try:
            check_ancestors(path, what)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @staticmethod
    def check(path: str, what: str = WHAT) -> bool:
        """What :meth:`open` refuses, asked without creating or opening anything (``hpkv
        doctor``): raises :class:`InsecurePath` for an existing ``path`` that is not private
        or an ancestor that is unsafe. Returns whether ``path`` exists (a missing one, and its
        missing parents, :meth:`open` creates 0700)."""
        try:
            st: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            check_private(st, path, what)
        check_ancestors(path, what, missing_ok=True)
        return st is not None

    @classmethod
    def attach(
        cls, path: str, identity: tuple[int, int] | list[int], max_dirs: int = DIR_CACHE_MAX
    ) -> StorageTree:
        """An IO worker's: open ``path`` and refuse it unless it is the directory the server
        verified (``identity``: its device and inode)."""
        fd = os.open(path, _DIR_FLAGS)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != tuple(identity):
                raise InsecurePath(
                    errno.ESTALE,
                    f"{WHAT} {path} is no longer the directory the server verified (device/inode "
                    f"{st.st_dev}/{st.st_ino}, expected {identity[0]}/{identity[1]}): it was replaced "
                    "while hpkv ran. Stop hpkv, check who changed it, and start hpkv again",
                )
            check_private(st, path, WHAT)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, max_dirs)

    def close(self) -> None:
        with self._lock:
            for rel in list(self._dirs):
                self._drop(rel)
        os.close(self.root_fd)
        self.root_fd = -1

    # ------------------------------------------------------------------ directories
    @contextmanager
    def dir(self, rel: str, create: bool = False) -> Iterator[int]:
        """A descriptor of ``rel`` (``"<fp>/<aa>/<bb>"``, ``"quarantine"``; "" is the root) for
        the ``with`` block; ``create`` makes missing directories 0700. Raises FileNotFoundError
        when missing, OSError (ELOOP, ENOTDIR) when a component is a symlink or a file."""
        if not rel:
            yield self.root_fd
            return
        d = self._acquire(rel, create)
        try:
            yield d.fd
        finally:
            self._release(d)

    def invalidate(self, rel: str) -> None:
        """Forget the cached descriptor of ``rel`` and of everything below it (it was
        found removed or replaced)."""
        with self._lock:
            for k in [k for k in self._dirs if k == rel or k.startswith(rel + "/")]:
                self._drop(k)

    def _acquire(self, rel: str, create: bool) -> _Dir:
        with self._lock:
            d = self._dirs.get(rel)
            if d is not None:
                if time.monotonic() - d.born < DIR_CACHE_TTL_S:
                    self._dirs.move_to_end(rel)
                    d.refs += 1
                    return d
                self._drop(rel)
        parent, _, name = rel.rpartition("/")
        with self.dir(parent, create) as pfd:
            d = _Dir(self._open_child(pfd, name, create))
        with self._lock:
            if rel in self._dirs:
                d.doomed = True  # another thread cached it meanwhile: ours is used once
            else:
                self._dirs[rel] = d
                while len(self._dirs) > self.max_dirs:
                    self._drop(next(iter(self._dirs)))
        return d

    def _open_child(self, pfd: int, name: str, create: bool) -> int:
        if name in ("", ".", ".."):  # every component is a name hpkv made; none leads up
            raise OSError(errno.EXDEV, f"{name!r} in a path below {self.path}")
        made = False
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=pfd)
                made = True
            except FileExistsError:
                pass  # another writer made it
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        if made:
            try:
                os.fchmod(fd, PRIVATE_DIR_MODE)  # the umask may have taken bits
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _release(self, d: _Dir) -> None:
        with self._lock:
            d.refs -= 1
            if d.doomed and d.refs == 0:
                os.close(d.fd)

    def _drop(self, rel: str) -> None:
        """Remove ``rel`` from the cache (lock held); closed now or by its last user."""
        d = self._dirs.pop(rel)
        d.doomed = True
        if d.refs == 0:
            os.close(d.fd)

    # ------------------------------------------------------------------ files
    def open_file(self, rel: str, name: str, flags: int) -> int:
        """A descriptor of ``rel/name``, never through a symlink: one ``openat2`` below the root
        (RESOLVE_BENEATH, no symlinks) where the kernel has it, else through the walk. A read
        of a file in a directory not cached costs one system call instead of three."""
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if "/" in name or name in ("", ".", ".."):
            raise OSError(errno.EXDEV, f"{name!r} is not a file name below {self.path}")
        if StorageTree.beneath:
            fd = lib.hpkv_open_beneath(self.root_fd, f"{rel}/{name}".encode(), flags, 0)
            if fd >= 0:
                return fd
            if fd not in (-errno.ENOSYS, -errno.EPERM):  # no openat2 (old kernel, seccomp)
                raise OSError(-fd, os.strerror(-fd), self.rel_path(rel, name))
            StorageTree.beneath = False
        with self.dir(rel) as dfd:
            return os.open(name, flags, dir_fd=dfd)

    def stat(self, rel: str, name: str) -> os.stat_result:
        """lstat of ``rel/name`` (a symlink is reported as one, never followed)."""
        d = self._acquire(rel, False)  # not `with self.dir()`: the server's lookups call this
        try:
            return os.stat(name, dir_fd=d.fd, follow_symlinks=False)
        finally:
            self._release(d)

    def stat_opened(self, rel: str, name: str) -> os.stat_result:
        """fstat of ``rel/name`` once opened (never through a symlink: ELOOP). An open asks the
        file server (NFS's close-to-open check, a FUSE daemon) where a stat may answer from the
        client's cached attributes for a file another host deleted."""
        fd = self.open_file(rel, name, os.O_RDONLY | os.O_NONBLOCK)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def unlink(self, rel: str, name: str) -> None:
        with self.dir(rel) as fd:
            os.unlink(name, dir_fd=fd)

    @contextmanager
    def entries(self, rel: str) -> Iterator[list[os.DirEntry]]:
        """The entries of ``rel`` ([] if it is missing) for the ``with`` block, read through a
        descriptor of their own (a shared one's read offset would mix two scans). Their
        ``stat()`` and ``is_dir()`` work inside the block only; ``path`` is the bare name."""
        try:
            with self.dir(rel) as fd:
                own = os.open(".", _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            own = -1
        if own < 0:
            yield []
            return
        try:
            with os.scandir(own) as it:
                yield list(it)
        finally:
            os.close(own)

    def rel_path(self, rel: str, name: str = "") -> str:
        """``rel/name`` as a path, for log lines only (never opened by name)."""
        return os.path.join(self.path, rel, name)
