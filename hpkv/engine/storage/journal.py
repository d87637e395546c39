"""The namespace journals: how servers sharing one storage directory learn each other's files
without walking the tree.

Each server (a *node*, :func:`node_id`) appends to one journal per namespace it writes,
``<storage>/<fingerprint>/.journal/<node>.log``, and only it writes that file: no two
clients ever append to one file (NFS has no atomic cross-client ``O_APPEND``). A record says
that a block's files were written (:data:`ADD`), used (:data:`READ`, coalesced) or deleted
(:data:`DEL`, by the evictor), with the wall-clock time it happened::

    header, HEADER_BYTES (64):  8s magic b"HPKVJRN1", u32 version, u32 record bytes,
                                u64 generation (ns; a new one at every compaction),
                                u32 pid of the writer (0 after a clean close), 4x,
                                32s node id
    records, RECORD_BYTES (40): u8 op, u8 world size, 2x, u64 time (ns since the epoch),
                                16s block key, u64 bytes of all its files,
                                u32 CRC32 of the 36 bytes before it

Readers tail every journal of a namespace from the offset they reached, reopening the file
at every poll (NFS close-to-open consistency revalidates its size and data at the open),
and take whole records only: a record not yet complete, or whose CRC does not match (an NFS
reader can see the size grow before the data), is read again at the next poll. A journal
is bounded: when it holds more than twice its writer's live blocks (plus
:data:`COMPACT_MIN_RECORDS`) it is rewritten as a snapshot of them under a temporary name
and renamed into place; a reader sees a new inode or generation and reads it from the
start.

The journals are hints, never the truth: a block a journal names is stat-ed before a lookup
first reports it, and a promote that finds its file gone recomputes. So a lost, stale or
reordered record costs a stat or a miss, never a wrong load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np

from hpkv.common.proc import pid_alive
from hpkv.common.security import PRIVATE_FILE_MODE
from hpkv.engine.storage.keytimes import KeyTimes
from hpkv.io_workers.tree import StorageTree

MAGIC = b"HPKVJRN1"
VERSION = 1
JOURNAL_DIR = ".journal"
SUFFIX = ".log"
ADD, READ, DEL = 1, 2, 3
_HDR = struct.Struct("<8sIIQI4x32s")
_REC = struct.Struct("<BB2xQ16sQI")
HEADER_BYTES = _HDR.size
RECORD_BYTES = _REC.size
assert HEADER_BYTES == 64 and RECORD_BYTES == 40
# _REC as a numpy record, to pack many records without an object each
_REC_ARRAY = np.dtype(
    {
        "names": ["op", "world", "time", "key", "nbytes", "crc"],
        "formats": ["u1", "u1", "<u8", "S16", "<u8", "<u4"],
        "offsets": [0, 1, 4, 12, 28, 36],
        "itemsize": RECORD_BYTES,
    }
)
COMPACT_MIN_RECORDS = 4096  # a journal is never compacted below this many records
READ_MAX_BYTES = 64 << 20  # bytes of records one poll reads from one journal (the rest: next poll)


def node_id(pool_path: str) -> str:
    """This server's name in the journals: the host name and a hash of the machine id, the
    mount namespace and the pool path. Stable across restarts of the same server; two servers
    on one machine (other pool directories or mount namespaces) are two nodes."""
    parts = [os.path.realpath(pool_path)]
    try:
        with open("/etc/machine-id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/mnt").st_ino))
    except OSError:
        parts.append("")
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:20] or "host"
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=5).hexdigest()
    return f"{host}-{digest}"


def journal_dir(fingerprint: str) -> str:
    return f"{fingerprint}/{JOURNAL_DIR}"


@dataclass(frozen=True)
class Record:
    op: int
    world: int
    time_ns: int
    key: bytes
    nbytes: int


@dataclass(frozen=True)
class Adds:
    """ADD records of many blocks with one time and shape (a scan's finds): the keys lie end to
    end in ``keys``, 16 bytes each, so that a million of them are one bytes object."""

    world: int
    time_ns: int
    keys: bytes
    nbytes: int


def pack_record(r: Record) -> bytes:
    body = _REC.pack(r.op, r.world, r.time_ns, r.key, r.nbytes, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def pack_records(op: int, world: np.ndarray | int, times, keys, nbytes) -> memoryview:
    """Records of ``op`` for the keys of ``keys`` (an ``S16`` array), the other fields arrays
    of as many or one value each: what :func:`pack_record` gives, for many at once (one
    buffer, no object a record)."""
    recs = np.zeros(len(keys), _REC_ARRAY)
    recs["op"], recs["world"], recs["time"], recs["key"], recs["nbytes"] = op, world, times, keys, nbytes
    raw = recs.view(np.uint8).data
    body = RECORD_BYTES - 4
    recs["crc"] = np.fromiter(
        (zlib.crc32(raw[i : i + body]) for i in range(0, len(raw), RECORD_BYTES)), np.uint32, len(recs)
    )
    return raw


def unpack_records(buf: bytes) -> tuple[list[Record], int]:
    """The valid records at the start of ``buf`` and the bytes they take (a torn or not yet
    visible record ends the list)."""
    out: list[Record] = []
    n = len(buf) // RECORD_BYTES
    for i in range(n):
        chunk = buf[i * RECORD_BYTES : (i + 1) * RECORD_BYTES]
        op, world, t, key, nbytes, crc = _REC.unpack(chunk)
        if crc != zlib.crc32(chunk[:-4]) or op not in (ADD, READ, DEL):
            return out, i * RECORD_BYTES
        out.append(Record(op, world, t, key, nbytes))
    return out, n * RECORD_BYTES


def _header(generation: int, pid: int, node: str) -> bytes:
    return _HDR.pack(MAGIC, VERSION, RECORD_BYTES, generation, pid, node.encode()[:32])


@dataclass
class Header:
    generation: int
    pid: int
    node: str


def unpack_header(buf: bytes) -> Header | None:
    if len(buf) < HEADER_BYTES:
        return None
    magic, version, rec, gen, pid, node = _HDR.unpack(buf[:HEADER_BYTES])
    if magic != MAGIC or version != VERSION or rec != RECORD_BYTES:
        return None
    return Header(gen, pid, node.rstrip(b"\0").decode(errors="replace"))


class JournalWriter:
    """This node's journal of one namespace: appends (one ``write`` per batch) and compaction.
    Used by the shared-directory thread, and by a scan thread while its namespace attaches."""

    def __init__(self, tree: StorageTree, fingerprint: str, node: str):
        self.tree = tree
        self.rel = journal_dir(fingerprint)
        self.node = node
        self.name = node + SUFFIX
        self.fd = -1
        self.records = 0  # records in the file now
        # blocks this node wrote, as of their last record: time and shape (an index into shapes)
        self.live = KeyTimes()
        self.shapes: list[tuple[int, int]] = []  # (world, nbytes): one per namespace, in practice
        self.loaded = False  # live holds what the journal of the last run held
        self._lock = threading.Lock()  # the file: opened, appended to, compacted by one thread at a time

    def apply(self, r: Record, mine: bool) -> None:
        """Keep :attr:`live` up to date with a record (``mine``: this node's)."""
        if r.op == DEL:
            old = self.live.get(r.key)
            if old is not None and old[0] <= r.time_ns:
                self.live.remove(r.key)
        elif r.op == ADD and mine:
            old = self.live.get(r.key)
            if old is None or old[0] < r.time_ns:
                self.live.put(r.key, r.time_ns, self._shape(r.world, r.nbytes))
        elif r.op == READ:
            old = self.live.get(r.key)
            if old is not None and old[0] < r.time_ns:
                self.live.put(r.key, r.time_ns, old[1])

    def apply_adds(self, adds: Adds) -> Adds:
        """:meth:`apply` of this node's ``adds``; returns those of blocks not live already."""
        fresh = self.live.missing(adds.keys)
        self.live.put_many(fresh, adds.time_ns, self._shape(adds.world, adds.nbytes))
        return Adds(adds.world, adds.time_ns, fresh, adds.nbytes)

    def _shape(self, world: int, nbytes: int) -> int:
        try:
            return self.shapes.index((world, nbytes))
        except ValueError:
            self.shapes.append((world, nbytes))
            return len(self.shapes) - 1

    def ensure_open(self) -> None:
        """Open this run's journal: a snapshot of what this node's journal of the last run
        holds (when the attach did not read it already)."""
        with self._lock:
            if self.fd < 0:
                self._open()

    def _open(self) -> None:
        if not self.loaded:
            reader = JournalReader(self.tree, self.rel.split("/")[0])
            try:
                while True:
                    recs = reader.read_one(self.name)
                    if not recs:
                        break
                    for r in recs:
                        self.apply(r, mine=True)
            except FileNotFoundError:
                pass
        self.loaded = True
        self._compact()

    def append(self, records: list[Record | Adds]) -> None:
        """Append records (raises OSError); compacts when the file grew too long."""
        if not records:
            return
        with self._lock:
            self._append(records)

    def _append(self, records: list[Record | Adds]) -> None:
        if self.fd < 0:
            self._open()
        if os.fstat(self.fd).st_nlink == 0:
            self._compact()  # removed from outside: write a new one
        data = memoryview(b"".join(map(_pack, records)))
        count = len(data) // RECORD_BYTES
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:
            # a partial record would hide every later one from readers: start a new file
            os.close(self.fd)
            self.fd = -1
            raise
        self.records += count
        if self.records > 2 * len(self.live) + COMPACT_MIN_RECORDS:
            self._compact()

    def compact(self) -> None:
        """Rewrite the journal as the snapshot of :attr:`live` (temporary name, then rename)."""
        with self._lock:
            self._compact()

    def _compact(self) -> None:
        tmp = f".{self.name}.{os.getpid()}.tmp"
        keys, times, tags = self.live.by_time()
        shapes = np.array(self.shapes or [(0, 0)], np.uint64).reshape(-1, 2)[tags]
        body = _header(time.time_ns(), os.getpid(), self.node)
        body += pack_records(ADD, shapes[:, 0], times, keys, shapes[:, 1])
        del keys, times, tags, shapes
        with self.tree.dir(self.rel, create=True) as dfd:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                PRIVATE_FILE_MODE,
                dir_fd=dfd,
            )
            try:
                try:
                    view = memoryview(body)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                os.rename(tmp, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                # ENOSPC and the like: a half-written snapshot would only hold space (the old
                # journal stays in use, and its appends go on)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            new = os.open(self.name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = new
        self.records = len(self.live)

    def close(self) -> None:
        """A clean close: the header's pid becomes 0 (a next run need not look for files
        left half-written by this one)."""
        if self.fd < 0:
            return
        try:
            # the append descriptor ignores offsets (O_APPEND): the header through another one
            with self.tree.dir(self.rel) as dfd:
                fd = os.open(self.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    os.pwrite(fd, struct.pack("<I", 0), 24)
                finally:
                    os.close(fd)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def _pack(r: Record | Adds) -> bytes | memoryview:
    if isinstance(r, Adds):
        return pack_records(ADD, r.world, r.time_ns, np.frombuffer(r.keys, "S16"), r.nbytes)
    return pack_record(r)


@dataclass
class _Tail:
    ino: int
    generation: int
    offset: int


class JournalReader:
    """The tails of every journal of one namespace: what each poll adds. Used by one thread."""

    def __init__(self, tree: StorageTree, fingerprint: str, skip: str | None = None):
        self.tree = tree
        self.rel = journal_dir(fingerprint)
        self.skip = skip  # a journal not to tail (this node's own, after the first read)
        self._tails: dict[str, _Tail] = {}
        self.headers: dict[str, Header] = {}
        self.journals = 0  # journals seen at the last poll

    def exists(self) -> bool:
        """Is there any journal of this namespace (one directory read)?"""
        with self.tree.entries(self.rel) as entries:
            return any(e.name.endswith(SUFFIX) and not e.name.startswith(".") for e in entries)

    def poll(self) -> dict[str, list[Record]]:
        """New records per journal file since the last poll (one directory read, and per
        journal one open, fstat and read). Raises OSError for errors other than a journal
        that vanished."""
        with self.tree.entries(self.rel) as entries:
            names = [e.name for e in entries if e.name.endswith(SUFFIX) and not e.name.startswith(".")]
        self.journals = len(names)
        out: dict[str, list[Record]] = {}
        for name in names:
            if name == self.skip and name in self._tails:
                continue
            try:
                recs = self.read_one(name)
            except FileNotFoundError:
                continue
            if recs:
                out[name] = recs
        return out

    def read_one(self, name: str) -> list[Record]:
        """The new records of the journal ``name`` (raises FileNotFoundError)."""
        fd = self.tree.open_file(self.rel, name, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            tail = self._tails.get(name)
            if tail is None or tail.ino != st.st_ino or st.st_size < tail.offset:
                head = os.pread(fd, HEADER_BYTES, 0)
                h = unpack_header(head)
                if h is None:
                    return []
                self.headers[name] = h
                tail = _Tail(st.st_ino, h.generation, HEADER_BYTES)
                self._tails[name] = tail
            if st.st_size <= tail.offset:
                return []
            want = min(st.st_size - tail.offset, READ_MAX_BYTES)
            buf = os.pread(fd, want - want % RECORD_BYTES, tail.offset)
        finally:
            os.close(fd)
        recs, used = unpack_records(buf)
        tail.offset += used
        return recs


def writer_crashed(h: Header | None) -> bool:
    """This node's journal of the last run was not closed cleanly, and its writer is gone:
    that run may have left temporary files behind."""
    return h is not None and h.pid != 0 and h.pid != os.getpid() and not pid_alive(h.pid)


def is_gone(exc: OSError) -> bool:
    return exc.errno in (errno.ENOENT, errno.ESTALE)
