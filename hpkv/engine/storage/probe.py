"""Does the storage directory take O_DIRECT? Asked once, at server start.

File systems answer in three ways, so the probe opens, writes and reads back:

* ext4/xfs/btrfs on a block device: O_DIRECT works with 512- or 4096-byte aligned
  buffers, offsets and lengths (EINVAL otherwise; hpkv always aligns to 4096);
* ramfs, some FUSE and overlay set-ups, older NFS: ``open(O_DIRECT)`` itself fails
  with EINVAL;
* tmpfs (Linux ≥ 6.6) accepts O_DIRECT and silently does buffered IO: harmless.

A file system may also accept the open and refuse the first IO (EINVAL from
pwrite), which is why a 4096-byte write and read are part of the probe. The IO
workers use buffered IO when the probe fails. One that refuses later anyway (EINVAL from
a read of a file opened with O_DIRECT) costs one buffered retry of that read: the worker
reads buffered from then on and says so once (:meth:`hpkv.io_workers.kvfile.KvFileIO.fetch`).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from dataclasses import dataclass

from hpkv.common.checks import filesystem_type

PROBE_BYTES = 4096


@dataclass(frozen=True)
class DirectIoProbe:
    ok: bool
    fs_type: str
    reason: str | None  # "EINVAL on ramfs (open)" when not ok

    def describe(self, path: str) -> str:
        if self.ok:
            return f"O_DIRECT works on {path} ({self.fs_type}): KV files bypass the page cache"
        return (
            f"O_DIRECT is not usable on {path}: {self.reason}; the IO workers fall back to "
            "buffered IO (reads may come from the page cache, writes go through it)"
        )


def probe_o_direct(directory: str, dir_fd: int | None = None) -> DirectIoProbe:
    """Open, write and read back one 4096-byte block with O_DIRECT in ``directory`` (through
    ``dir_fd``, its verified descriptor, when given)."""
    fs = filesystem_type(directory)
    name = f".hpkv-odirect-probe-{os.getpid()}-{secrets.token_hex(4)}"
    path = name if dir_fd is not None else os.path.join(directory, name)
    buf = mmap.mmap(-1, PROBE_BYTES)
    back = mmap.mmap(-1, PROBE_BYTES)
    pattern = secrets.token_bytes(PROBE_BYTES)
    buf[:] = pattern
    step = "open"
    fd = -1
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
        step = "pwrite"
        if os.pwritev(fd, [buf], 0) != PROBE_BYTES:
            return DirectIoProbe(False, fs, f"short write on {fs} (pwrite)")
        step = "pread"
        if os.preadv(fd, [back], 0) != PROBE_BYTES or back[:] != pattern:
            return DirectIoProbe(False, fs, f"read back differs on {fs} (pread)")
        return DirectIoProbe(True, fs, None)
    except OSError as exc:
        if step != "open" and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DirectIoProbe(True, fs, None)  # O_DIRECT opened fine; the disk is just full
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return DirectIoProbe(False, fs, f"{name} on {fs} ({step})")
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(path, dir_fd=dir_fd)
        except OSError:
            pass
        buf.close()
        back.close()


def virtio_disk(directory: str) -> str | None:
    """The virtio-blk disk (e.g. ``vda``) holding ``directory``, or None (NVMe, SCSI, network
    and RAM file systems).

    Why it matters: on the VM hpkv is developed on (a virtio-blk disk served by the VMM),
    O_DIRECT reads straight into the shared-memory pool ran at ≈ 0.5–0.9 GB/s against
    ≈ 1.0–1.5 GB/s into private memory of the reading process, so promotes read into a
    private buffer there and copy (``HPKV_STORAGE_READ_BOUNCE``). Real NVMe DMA has no
    such penalty and keeps the zero-copy path.
    """
    try:
        dev = os.stat(directory).st_dev
        sysfs = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    except OSError:
        return None
    parts = sysfs.split(os.sep)
    if not any(p.startswith("virtio") for p in parts):
        return None
    i = max(i for i, p in enumerate(parts) if p == "block")
    return parts[i + 1] if i + 1 < len(parts) else None
