"""What the server checks of its deployment at start and ``hpkv doctor`` reports beforehand:
the file systems of the pool and storage directories, their free space, whether they can be
written. Each question answers without side effects; :func:`check_runtime` (the server's)
acts on them."""

from __future__ import annotations

import errno
import os
import tempfile
from dataclasses import dataclass

from hpkv.common.security import PRIVATE_DIR_MODE, makedirs_private
from hpkv.config import Config, ConfigError, Source, format_size

RAM_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class Mount:
    """The mount holding a path (an entry of /proc/mounts)."""

    mountpoint: str
    fstype: str
    options: tuple[str, ...]


def mount_of(path: str) -> Mount:
    """The mount holding ``path`` (or its nearest existing parent); reads /proc/mounts only, so
    it answers even when that file system hangs."""
    import psutil

    path = os.path.realpath(_existing_ancestor(path))
    best = Mount("", "unknown", ())
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best.mountpoint):
            best = Mount(mp, part.fstype, tuple(part.opts.split(",")) if part.opts else ())
    return best


def filesystem_type(path: str) -> str:
    """The type of the file system holding ``path`` (or its nearest existing parent)."""
    return mount_of(path).fstype


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def existing_ancestor(path: str) -> str:
    """``path`` if it exists, else its nearest parent that does."""
    return _existing_ancestor(path)


def free_bytes(path: str) -> int:
    st = os.statvfs(_existing_ancestor(path))
    return st.f_bavail * st.f_frsize


def memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def pool_room(pool_dir: str) -> int:
    """Bytes a pool file in ``pool_dir`` can take: its file system's free space, or on ramfs,
    which has no size limit (statvfs reports no blocks at all), the memory available."""
    st = os.statvfs(_existing_ancestor(pool_dir))
    if st.f_blocks == 0 and filesystem_type(pool_dir) == "ramfs":
        return memory_available()
    return st.f_bavail * st.f_frsize


def pool_disk_warning(cfg: Config) -> str | None:
    """Why the pool directory's file system is wrong for a DRAM pool (not tmpfs or ramfs), or None."""
    fstype = filesystem_type(cfg.pool_dir)
    if fstype in RAM_FILESYSTEMS:
        return None
    return (
        f"HPKV_SHARE_MEM_FILE_PATH={cfg.pool_dir} (from {cfg.source('HPKV_SHARE_MEM_FILE_PATH')}) is "
        f"on {fstype}, not tmpfs or ramfs: the DRAM pool would be a disk-backed file whose pages the "
        "kernel writes back and can evict, so 'DRAM' hits may run at disk speed and the disk fills "
        "with pool traffic. Use a directory under /dev/shm (or another tmpfs/ramfs mount)."
    )


def pool_space_error(cfg: Config) -> str | None:
    """Why a pool of ``HPKV_KV_MEM_POOL_SIZE`` does not fit its directory's file system, or None
    (a pool file left by a previous server counts as room: the server replaces it)."""
    pool_file = os.path.join(cfg.pool_dir, "pool")
    existing = os.path.getsize(pool_file) if os.path.isfile(pool_file) else 0
    available = pool_room(cfg.pool_dir) + existing
    if cfg.pool_size <= available:
        return None
    return (
        f"HPKV_KV_MEM_POOL_SIZE={cfg.settings['HPKV_KV_MEM_POOL_SIZE'].raw} "
        f"(from {cfg.source('HPKV_KV_MEM_POOL_SIZE')}) is {format_size(cfg.pool_size)} "
        f"({cfg.pool_size} bytes), but the file system of {cfg.pool_dir} has only "
        f"{format_size(available)} ({available} bytes) free: lower the pool size or free space."
    )


def write_probe_error(key: str, path: str, source: Source) -> str | None:
    """Why this process cannot create a file in the existing directory ``path``, or None. The
    probe file is removed at once."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".hpkv-write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
        return None
    except OSError as exc:
        st = os.stat(path)
        return (
            f"{key}={path} (from {source}) is not writable by uid {os.getuid()}: {exc.strerror} "
            f"(owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); "
            "fix its permissions or choose another path"
        )


def _ensure_writable_dir(key: str, path: str, source: Source, mode: int = 0o755) -> None:
    what = f"{key}={path} (from {source})"
    try:
        if mode == PRIVATE_DIR_MODE:  # its missing parents too: 0700 whatever the umask
            makedirs_private(os.path.dirname(os.path.abspath(path)))
        os.makedirs(path, mode=mode, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{what}: cannot create the directory: {exc.strerror} "
            f"({errno.errorcode.get(exc.errno or 0, exc.errno)} on {exc.filename}); "
            "create it yourself or choose another path"
        ) from None
    if not os.path.isdir(path):
        raise ConfigError(f"{what} exists but is not a directory")
    problem = write_probe_error(key, path, source)
    if problem:
        raise ConfigError(problem)


def check_runtime(cfg: Config) -> list[str]:
    """Check the machine against the configuration; return warnings, raise ConfigError.

    Creates the storage directory and the pool directory if missing.
    """
    warnings: list[str] = []
    disk = pool_disk_warning(cfg)
    if disk:
        warnings.append(disk)
    _ensure_writable_dir(
        "HPKV_SHARE_MEM_FILE_PATH", cfg.pool_dir, cfg.source("HPKV_SHARE_MEM_FILE_PATH"), mode=0o700
    )
    space = pool_space_error(cfg)
    if space:
        raise ConfigError(space)
    if cfg.storage_path is not None:
        _ensure_writable_dir(
            "HPKV_KV_STORAGE_PATH", cfg.storage_path, cfg.source("HPKV_KV_STORAGE_PATH"), mode=0o700
        )
    return warnings
