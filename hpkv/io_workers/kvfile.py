"""The KV file: its format, its path, and how one file is written and read. Defined here only.

A KV file holds one rank's shard of one block::

    offset 0      header, HEADER_BYTES (4096) bytes, little-endian:
                    0  8s  magic b"HPKVBLK1"
                    8  u32 format version (hpkv.protocol.keys.FORMAT_VERSION)
                   12  u32 header bytes (4096)
                   16  16s namespace fingerprint (raw 16 bytes of the 32-hex fingerprint)
                   32  16s block key
                   48  u32 rank          52  u32 world size
                   56  u64 payload length (bytes, unpadded)
                   64  u32 CRC32C of the payload
                   68  u32 CRC32C of the whole 4096-byte header with this field zeroed
                   72  u64 creation time (ns since the epoch)
                   80  zeros up to 4096
    offset 4096   payload, zero-padded to a multiple of 4096

so every byte of the file is verified on read (header CRC, payload CRC, zero
padding) and O_DIRECT can move it with 4096-aligned offsets and lengths straight
between the file and a pool slot (slots are ``align_up(shard_bytes, 4096)`` long).

Paths: ``<storage>/<fingerprint>/<aa>/<bb>/<keyhex>-r<rank>.kv`` (``aa``, ``bb``: the
first two bytes of the key in hex), two directory levels so no directory grows past
a few hundred entries per million blocks. A file is written as
``.<keyhex>-r<rank>.kv.<host>.<pid>.tmp`` in the same directory and renamed into
place, so no reader ever sees a partial file; the host and pid in the temporary name
tell which writer left it behind if one dies. Corrupt files are moved to
``<storage>/quarantine/`` (the server keeps it bounded). Files are created 0600 and
directories 0700, whatever the umask: a KV file holds a prompt's KV, readable only by
the user who runs hpkv. Every file is opened relative to its directory's verified
descriptor (:mod:`hpkv.io_workers.tree`) with O_NOFOLLOW, the temporary file also with
O_EXCL: nothing planted at a name is followed or overwritten. A read sets the file's access
time (:func:`leave_access_time`): the evictor of a shared directory spares files read recently.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from hpkv.common.security import PRIVATE_FILE_MODE
from hpkv.io_workers.checksum import crc32c, crc32c_copy
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol.keys import FORMAT_VERSION, KEY_BYTES

MAGIC = b"HPKVBLK1"
HEADER_BYTES = 4096
FILE_ALIGN = 4096  # payload padding and O_DIRECT granularity
QUARANTINE_DIR = "quarantine"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"

_HDR = struct.Struct("<8sII16s16sIIQII Q")
_HDR_CRC_AT = 68
assert _HDR.size == 80

_NAME_RE = re.compile(r"^([0-9a-f]{32})-r(\d+)\.kv$")
log = logging.getLogger("hpkv.io")
_HOST = socket.gethostname().replace(".", "_").replace("/", "_")[:32] or "host"


def align_up(n: int, a: int = FILE_ALIGN) -> int:
    return (n + a - 1) // a * a


def file_size(payload_len: int) -> int:
    """Bytes on disk of a KV file with a payload of ``payload_len`` bytes."""
    return HEADER_BYTES + align_up(payload_len)


class CorruptFile(ValueError):
    """A KV file whose header, length, padding or checksum does not match what was asked."""


class BlockId(NamedTuple):
    """Which shard a file holds: namespace fingerprint (16 raw bytes), key, rank, world size."""

    namespace: bytes
    key: bytes
    rank: int
    world: int


@dataclass(frozen=True)
class Header:
    block: BlockId
    payload_len: int
    payload_crc: int
    created_ns: int


# ------------------------------------------------------------------ paths
def rel_dir(fingerprint: str, key: bytes) -> str:
    kh = key.hex()
    return os.path.join(fingerprint, kh[:2], kh[2:4])


def file_name(key: bytes, rank: int) -> str:
    return f"{key.hex()}-r{rank}{SUFFIX}"


def file_path(root: str, fingerprint: str, key: bytes, rank: int) -> str:
    return os.path.join(root, rel_dir(fingerprint, key), file_name(key, rank))


def tmp_name(name: str, pid: int | None = None, host: str = _HOST) -> str:
    """The temporary name the file ``name`` is written under by process ``pid`` on ``host``
    (in the same directory)."""
    return f".{name}.{host}.{os.getpid() if pid is None else pid}{TMP_SUFFIX}"


def parse_name(name: str) -> tuple[bytes, int] | None:
    """``<keyhex>-r<rank>.kv`` → (key, rank); None for anything else."""
    m = _NAME_RE.match(name)
    return (bytes.fromhex(m.group(1)), int(m.group(2))) if m else None


def parse_tmp_name(name: str) -> tuple[str, int] | None:
    """``.<final>.<host>.<pid>.tmp`` → (host, pid); None for anything else."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return None
    parts = name[1 : -len(TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def this_host() -> str:
    return _HOST


def leave_access_time(fd: int, st: os.stat_result) -> None:
    """Mark an opened KV file as read now: its access time is set (its modification time kept),
    whatever the mount's ``noatime``/``relatime``. The evictor of a shared directory never deletes
    a file whose access time is after its modification time and within
    ``HPKV_STORAGE_READ_GRACE`` (one SETATTR per read on NFS). Failure is harmless: the file is
    then only protected by the journals' recency."""
    try:
        os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
    except OSError:
        pass


def quarantine_name(name: str) -> str:
    """The name the corrupt file ``name`` gets in ``<storage>/quarantine/``."""
    return f"{name}.{time.time_ns()}"


# ------------------------------------------------------------------ header
def pack_header(buf: memoryview, block: BlockId, payload_len: int, payload_crc: int) -> None:
    """Write the 4096-byte header of ``block`` into ``buf`` (all of it, padding included)."""
    buf[:HEADER_BYTES] = bytes(HEADER_BYTES)
    _HDR.pack_into(
        buf,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        block.namespace,
        block.key,
        block.rank,
        block.world,
        payload_len,
        payload_crc,
        0,
        time.time_ns(),
    )
    struct.pack_into("<I", buf, _HDR_CRC_AT, crc32c(buf[:HEADER_BYTES]))


def unpack_header(buf: memoryview) -> Header:
    """Parse and verify a header; raises :class:`CorruptFile` saying what is wrong."""
    (magic, version, hdr_bytes, namespace, key, rank, world, payload_len, payload_crc, hdr_crc, created) = (
        _HDR.unpack_from(buf, 0)
    )
    if magic != MAGIC:
        raise CorruptFile(f"bad magic {magic!r}")
    check = bytearray(buf[:HEADER_BYTES])
    check[_HDR_CRC_AT : _HDR_CRC_AT + 4] = b"\0\0\0\0"
    if crc32c(check) != hdr_crc:
        raise CorruptFile("header checksum mismatch")
    if version != FORMAT_VERSION or hdr_bytes != HEADER_BYTES:
        raise CorruptFile(
            f"format version {version} / header {hdr_bytes} B, expected {FORMAT_VERSION} / {HEADER_BYTES} B"
        )
    return Header(BlockId(namespace, key, rank, world), payload_len, payload_crc, created)


def fingerprint_bytes(fingerprint: str) -> bytes:
    raw = bytes.fromhex(fingerprint)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"namespace fingerprint {fingerprint!r} is not {KEY_BYTES} bytes of hex")
    return raw


# ------------------------------------------------------------------ one file
class ReadSlot:
    """The buffers of one read in flight: its header page and, for bounce reads, a private
    payload buffer (grown on demand). Page-aligned, as O_DIRECT wants."""

    def __init__(self) -> None:
        self._hdr_mm = mmap.mmap(-1, HEADER_BYTES)
        self.hdr = memoryview(self._hdr_mm)
        self._bounce_mm: mmap.mmap | None = None
        self._bounce: memoryview | None = None

    def bounce(self, n: int) -> memoryview:
        if self._bounce is None or len(self._bounce) < n:
            self._release_bounce()
            mm = self._bounce_mm = mmap.mmap(-1, n)
            self._bounce = memoryview(mm)
        return self._bounce[:n]

    def _release_bounce(self) -> None:
        if self._bounce is not None:
            self._bounce.release()
            self._bounce = None
        if self._bounce_mm is not None:
            try:
                self._bounce_mm.close()
            except BufferError:
                pass  # a fetched file's view may still hold it: unmapped with the last view
            self._bounce_mm = None

    def close(self) -> None:
        self.hdr.release()
        self._hdr_mm.close()
        self._release_bounce()


@dataclass(frozen=True)
class FetchedFile:
    """A KV file read by :meth:`KvFileIO.fetch`, not yet verified."""

    block: BlockId
    length: int
    payload: memoryview  # the pool range it promotes into
    dest: memoryview  # where the payload was read: ``payload``, or the slot's bounce buffer
    slot: ReadSlot


class KvFileIO:
    """Writes and reads KV files straight between a pool mapping and the file system.

    ``pool`` is a writable memoryview of the whole pool (page-aligned; slots are
    4096-aligned), so with O_DIRECT the payload moves between the pool and the
    device with no bounce buffer; only the 4096-byte header uses a buffer of ours.
    One instance per thread, except that :meth:`verify` of a fetched file may run in another
    thread while this one fetches into a different :class:`ReadSlot`.
    """

    def __init__(
        self,
        root: str | StorageTree,
        pool: memoryview,
        o_direct: bool,
        fsync: bool = False,
        bounce_reads: bool = False,
    ):
        # An IO worker gets the tree the server verified; a path (tests, tools) is opened here.
        self._own_tree = not isinstance(root, StorageTree)
        self.tree = StorageTree.open(root) if isinstance(root, str) else root
        self.root = self.tree.path
        self.pool = pool
        self.o_direct = o_direct
        self.read_direct = o_direct  # off alone when only reads are refused (EINVAL from pread)
        self.fsync = fsync
        self.bounce_reads = bounce_reads
        self._hdr_mm = mmap.mmap(-1, HEADER_BYTES)  # page-aligned, as O_DIRECT wants
        self.hdr = memoryview(self._hdr_mm)  # the header of the file being written
        self._read_slot = ReadSlot()
        self.fell_back = False  # O_DIRECT refused at run time → buffered

    def _flags(self) -> int:
        return os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.o_direct else 0)

    def write(self, fingerprint: str, block: BlockId, offset: int, length: int) -> tuple[int, bool]:
        """Spill pool bytes ``[offset, offset+length)`` as the block's file.

        Returns (bytes written, existed): a complete file already in place (another
        writer, another node) is not written again. On any error the temporary file
        is removed and the OSError propagates (ENOSPC included).
        """
        rel, name = rel_dir(fingerprint, block.key), file_name(block.key, block.rank)
        try:
            return self._write_in(rel, name, block, offset, length)
        except FileNotFoundError:
            # A cached directory was removed from outside (the namespace deleted by hand):
            # walk again from the root, creating what is missing.
            self.tree.invalidate(fingerprint)
            return self._write_in(rel, name, block, offset, length)

    def _write_in(self, rel: str, name: str, block: BlockId, offset: int, length: int) -> tuple[int, bool]:
        want = file_size(length)
        padded = align_up(length)
        payload = self.pool[offset : offset + padded]
        if len(payload) != padded:
            raise ValueError(f"pool range {offset}+{padded} is outside the pool")
        with self.tree.dir(rel, create=True) as dfd:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size == want:
                    return 0, True
            except FileNotFoundError:
                pass
            payload[length:] = bytes(padded - length)  # the slot's tail is ours: zero padding on disk
            pack_header(self.hdr, block, length, crc32c(payload[:length]))
            tmp = tmp_name(name)
            fd = self._open_tmp(dfd, rel, tmp)
            try:
                try:
                    _pwrite_all(fd, [self.hdr, payload], want)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self.o_direct:
                        raise
                    self._fall_back()  # O_DIRECT refused at run time: retry buffered
                    _set_direct(fd, False)
                    _pwrite_all(fd, [self.hdr, payload], want)
                if self.fsync:
                    os.fsync(fd)
                os.close(fd)
                fd = -1
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                _unlink_quietly(tmp, dfd)
                raise
        return want, False

    def _open_tmp(self, dfd: int, rel: str, tmp: str) -> int:
        """Create ``tmp`` in ``dfd``: O_EXCL and O_NOFOLLOW, so nothing already there (a
        symlink, another file) is ever followed or truncated."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        for attempt in range(2):
            try:
                try:
                    return os.open(tmp, flags | self._flags(), PRIVATE_FILE_MODE, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self.o_direct:
                        raise
                    self._fall_back()
                    _unlink_quietly(tmp, dfd)  # the failed open may have created it
                    return os.open(tmp, flags | self._flags(), PRIVATE_FILE_MODE, dir_fd=dfd)
            except FileExistsError:
                if attempt:
                    raise
                # Our host and pid are in the name: what is there is a leftover of a dead
                # writer whose pid we got, or was put there. Removed (unlink never follows a
                # symlink), never written through.
                st = os.stat(tmp, dir_fd=dfd, follow_symlinks=False)
                log.warning(
                    "removed %s, found at this IO worker's temporary name (%s, owner uid %d): "
                    "not written through; the KV file is written anew",
                    self.tree.rel_path(rel, tmp),
                    "a symlink" if stat.S_ISLNK(st.st_mode) else f"mode {stat.S_IMODE(st.st_mode):04o}",
                    st.st_uid,
                )
                os.unlink(tmp, dir_fd=dfd)
        raise AssertionError("unreachable")

    def read(self, fingerprint: str, block: BlockId, offset: int, length: int) -> int:
        """Promote the block's file into pool bytes ``[offset, offset+align_up(length))``.

        Returns the bytes read. Raises FileNotFoundError when there is no file,
        :class:`CorruptFile` when anything in it does not match ``block``/``length``
        (the caller quarantines it), OSError for IO errors.
        """
        return self.verify(self.fetch(fingerprint, block, offset, length, self._read_slot))

    def fetch(
        self, fingerprint: str, block: BlockId, offset: int, length: int, slot: ReadSlot
    ) -> FetchedFile:
        """The IO half of :meth:`read`: the file's bytes into ``slot`` (header, and the payload
        with bounce reads) and the pool (the payload otherwise), nothing checked but the file's
        size. :meth:`verify` finishes it, possibly in another thread while this one fetches the
        next file into another slot."""
        rel, name = rel_dir(fingerprint, block.key), file_name(block.key, block.rank)
        want = file_size(length)
        padded = align_up(length)
        payload = self.pool[offset : offset + padded]
        if len(payload) != padded:
            raise ValueError(f"pool range {offset}+{padded} is outside the pool")
        try:
            fd = self._open_read(rel, name)
        except FileNotFoundError:
            self.tree.invalidate(fingerprint)  # a cached directory may be stale: walk again
            fd = self._open_read(rel, name)
        dest = slot.bounce(padded) if self.bounce_reads else payload
        try:
            st = os.fstat(fd)
            size = st.st_size
            leave_access_time(fd, st)
            if size != want:
                raise CorruptFile(f"file is {size} bytes, expected {want} for a {length}-byte payload")
            try:
                got = _pread_all(fd, [slot.hdr, dest])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.read_direct:
                    raise
                # O_DIRECT opened but the read was refused (some FUSE, NFS, overlay set-ups):
                # this file again buffered, and every later read too (the caller logs it).
                self.read_direct = False
                self.fell_back = True
                _set_direct(fd, False)
                got = _pread_all(fd, [slot.hdr, dest])
        finally:
            os.close(fd)
        if got != want:
            raise CorruptFile(f"short read: {got} of {want} bytes")
        return FetchedFile(block, length, payload, dest, slot)

    def _open_read(self, rel: str, name: str) -> int:
        if not self.read_direct:
            return self.tree.open_file(rel, name, os.O_RDONLY)
        try:
            return self.tree.open_file(rel, name, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._fall_back()
            return self.tree.open_file(rel, name, os.O_RDONLY)

    @staticmethod
    def verify(f: FetchedFile) -> int:
        """The check half of :meth:`read`: header, padding and payload checksum of a fetched
        file, and with bounce reads its copy into the pool. Returns the file's bytes; raises
        :class:`CorruptFile`. Touches only ``f``'s slot and pool range."""
        length, payload, dest = f.length, f.payload, f.dest
        padded = len(payload)
        h = unpack_header(f.slot.hdr)
        if h.block != f.block:
            raise CorruptFile(f"header names {h.block}, expected {f.block}")
        if h.payload_len != length:
            raise CorruptFile(f"payload length {h.payload_len}, expected {length}")
        if dest[length:] != bytes(padded - length):
            raise CorruptFile("non-zero padding after the payload")
        if dest is payload:
            crc = crc32c(payload[:length])
        else:
            # Summed while copied into the pool (one pass over the bounce buffer). A bad
            # file's bytes in the slot are harmless: its promote fails and frees the slot.
            crc = crc32c_copy(payload[:length], dest[:length])
            payload[length:] = dest[length:]
        if crc != h.payload_crc:
            raise CorruptFile("payload checksum mismatch")
        return file_size(length)

    def quarantine(self, fingerprint: str, block: BlockId) -> str:
        """Move the block's file out of the way; returns where it went."""
        name = file_name(block.key, block.rank)
        dest = quarantine_name(name)
        with (
            self.tree.dir(rel_dir(fingerprint, block.key)) as src,
            self.tree.dir(QUARANTINE_DIR, create=True) as dst,
        ):
            os.rename(name, dest, src_dir_fd=src, dst_dir_fd=dst)
        return self.tree.rel_path(QUARANTINE_DIR, dest)

    def _fall_back(self) -> None:
        self.o_direct = self.read_direct = False
        self.fell_back = True

    def close(self) -> None:
        self.hdr.release()
        self._hdr_mm.close()
        self._read_slot.close()
        if self._own_tree:
            self.tree.close()


def _set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for an open file (Linux lets F_SETFL change it)."""
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_DIRECT if on else fl & ~os.O_DIRECT)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


def _pwrite_all(fd: int, bufs: list[memoryview], total: int) -> None:
    """pwritev until everything is written; a short write continues where it stopped."""
    done = 0
    while done < total:
        n = os.pwritev(fd, bufs, done)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n
        bufs = _advance(bufs, n)


def _pread_all(fd: int, bufs: list[memoryview]) -> int:
    """preadv until the buffers are full or end of file; returns the bytes read."""
    done = 0
    while bufs:
        n = os.preadv(fd, bufs, done)
        if n == 0:
            break
        done += n
        bufs = _advance(bufs, n)
    return done


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
