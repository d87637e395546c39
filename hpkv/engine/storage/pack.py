"""Packs: one namespace's KV files in one checksummed file (``hpkv export`` / ``hpkv import``).

A pack pre-warms a node or ships a system prompt's cache. Layout, little-endian::

    offset 0          head, HEAD_BYTES (4096): 8s magic b"HPKVPAK1", u32 pack version, zeros
    offset 4096       the KV files, byte for byte as on disk (:mod:`hpkv.io_workers.kvfile`:
                      4096-byte header, payload padded to 4096), each ``file_bytes`` long,
                      block after block in manifest order, ranks 0..world-1 within a block
    after them        the manifest: UTF-8 JSON (see :func:`_manifest`), at most MAX_MANIFEST
    last 64 bytes     tail: 8s magic b"HPKVPAKT", u32 pack version, u32 0,
                      u64 manifest offset, u64 manifest bytes, u32 CRC32C of the manifest,
                      u32 CRC32C of these 64 bytes with this field zeroed, 24 zeros

The manifest goes last so that an export streams: one pass over the files, one KV file in
memory at a time, and a file removed during the walk is left out instead of spoiling a
manifest already written. Every byte is checked on import: the tail's and the manifest's
CRC32C, each KV file's own header CRC and payload CRC32C (the checksum the files already
carry; the manifest repeats each payload's, so a file swapped for another valid one is
caught), its zero padding, and that its header names the manifest's namespace, key, rank,
world size and payload length. The pack's layout is fixed by its manifest: a file's offset
is ``4096 + i * file_bytes``, and nothing in the pack names a path; where a block lands is
decided by its key alone (``<fingerprint>/<aa>/<bb>/<key>-r<rank>.kv``).

Import verifies the whole pack before it writes anything, then writes each file through
:class:`~hpkv.io_workers.kvfile.KvFileIO` (the IO workers' own path: temporary name with
O_EXCL|O_NOFOLLOW below the verified storage tree, then rename; a file already there is not
written again) and journals the blocks as ADD records in a journal of its own
(``<fingerprint>/.journal/import-<node>.log``), so that running servers find them at their
next journal poll, a later attach reads them without a scan, and the directory's evictor
counts them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from hpkv import __version__
from hpkv.engine.storage.journal import SUFFIX, Adds, JournalReader, JournalWriter, journal_dir, node_id
from hpkv.io_workers import kvfile
from hpkv.io_workers.checksum import crc32c
from hpkv.io_workers.kvfile import BlockId, CorruptFile, KvFileIO
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol.keys import FORMAT_VERSION, KEY_BYTES

PACK_MAGIC = b"HPKVPAK1"
TAIL_MAGIC = b"HPKVPAKT"
PACK_VERSION = 1
HEAD_BYTES = 4096  # keeps every KV file in the pack 4096-aligned, as on disk
_TAIL = struct.Struct("<8sIIQQII24x")
TAIL_BYTES = _TAIL.size
_TAIL_CRC_AT = 36
assert TAIL_BYTES == 64
MAX_MANIFEST = 256 << 20  # ~60 bytes a block: room for millions of blocks, refused beyond
MAX_WORLD = 255  # the journals' world size is one byte
MAX_SHARD_BYTES = 1 << 30  # one rank's shard of one block; real ones are KiB to a few MiB
MAX_NAME = 256
_FP_RE = re.compile(r"^[0-9a-f]{32}$")


class PackError(ValueError):
    """A pack that is malformed, corrupt, or not for the target; nothing was written."""


class PackMismatch(PackError):
    """A valid pack for another namespace or model than the one the user named."""


@dataclass
class NamespaceInfo:
    """What a pack says about its namespace: the fingerprint and the layout, and the name and
    tokens per block when a running server knew them."""

    fingerprint: str
    world_size: int
    shard_bytes: int
    name: str = ""
    block_tokens: int = 0


@dataclass
class ExportReport:
    path: str
    namespace: NamespaceInfo
    blocks: int = 0
    files: int = 0
    bytes: int = 0
    skipped_incomplete: int = 0  # keys without every rank's file
    skipped_corrupt: int = 0  # files that failed verification (left in place, not quarantined)
    skipped_other: int = 0  # files of another layout (world size, payload length) or vanished
    problems: list[str] = field(default_factory=list)  # the first few, for the user

    def as_json(self) -> dict[str, Any]:
        return {
            "pack": self.path,
            "namespace": vars(self.namespace),
            "blocks": self.blocks,
            "files": self.files,
            "bytes": self.bytes,
            "skipped": {
                "incomplete": self.skipped_incomplete,
                "corrupt": self.skipped_corrupt,
                "other": self.skipped_other,
            },
            "problems": self.problems,
        }


@dataclass
class Manifest:
    namespace: NamespaceInfo
    model: dict[str, Any] | None
    keys: list[bytes]
    crcs: list[list[int]]  # per block, per rank: the payload's CRC32C
    file_bytes: int
    raw: dict[str, Any]

    @property
    def files(self) -> int:
        return len(self.keys) * self.namespace.world_size


@dataclass
class ImportReport:
    pack: str
    namespace: NamespaceInfo
    model: dict[str, Any] | None
    blocks: int = 0
    files_written: int = 0
    files_present: int = 0  # already in the tree: not written again
    bytes_written: int = 0
    verified_bytes: int = 0
    dry_run: bool = False
    journal: str = ""  # empty: not journaled (the namespace had files no journal lists)

    def as_json(self) -> dict[str, Any]:
        return {
            "pack": self.pack,
            "namespace": vars(self.namespace),
            "model": self.model,
            "blocks": self.blocks,
            "files_written": self.files_written,
            "files_present": self.files_present,
            "bytes_written": self.bytes_written,
            "verified_bytes": self.verified_bytes,
            "dry_run": self.dry_run,
            "journal": self.journal,
        }


# ------------------------------------------------------------------ one KV file image
class _FileBuf:
    """A page-aligned buffer of one KV file image (header + padded payload)."""

    def __init__(self, file_bytes: int):
        self._mm = mmap.mmap(-1, file_bytes)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        self.view.release()
        self._mm.close()


def check_image(img: memoryview, ns: NamespaceInfo, key: bytes, rank: int, crc: int | None = None) -> int:
    """Verify one KV file image against what it must be; returns its payload CRC32C. Raises
    :class:`CorruptFile` saying what is wrong (the same checks a promote makes)."""
    h = kvfile.unpack_header(img)  # magic, header CRC, format version
    want = BlockId(kvfile.fingerprint_bytes(ns.fingerprint), key, rank, ns.world_size)
    if h.block != want:
        raise CorruptFile(f"header names {h.block}, expected {want}")
    if h.payload_len != ns.shard_bytes:
        raise CorruptFile(f"payload length {h.payload_len}, expected {ns.shard_bytes}")
    start, end = kvfile.HEADER_BYTES, kvfile.HEADER_BYTES + ns.shard_bytes
    if img[end:] != bytes(len(img) - end):
        raise CorruptFile("non-zero padding after the payload")
    got = crc32c(img[start:end])
    if got != h.payload_crc:
        raise CorruptFile("payload checksum mismatch")
    if crc is not None and got != crc:
        raise CorruptFile(f"payload checksum {got:#010x}, the manifest says {crc:#010x}")
    return got


def _read_exact(fd: int, buf: memoryview, offset: int) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


# ------------------------------------------------------------------ export
def _pick_layout(
    tree: StorageTree, fp: str, leaf: str, key: bytes, buf: memoryview
) -> tuple[int, int] | None:
    """(world size, payload length) from the header of ``key``'s rank-0 file, None if unreadable."""
    try:
        fd = tree.open_file(leaf, kvfile.file_name(key, 0), os.O_RDONLY)
    except OSError:
        return None
    try:
        if _read_exact(fd, buf[: kvfile.HEADER_BYTES], 0) != kvfile.HEADER_BYTES:
            return None
        h = kvfile.unpack_header(buf)
    except CorruptFile:
        return None
    finally:
        os.close(fd)
    if h.block.namespace != kvfile.fingerprint_bytes(fp) or not 0 < h.block.world <= MAX_WORLD:
        return None
    if not 0 < h.payload_len <= MAX_SHARD_BYTES:
        return None
    return h.block.world, h.payload_len


def _leaves(tree: StorageTree, fp: str) -> Iterator[str]:
    def subdirs(rel: str) -> list[str]:
        with tree.entries(rel) as entries:
            return sorted(
                f"{rel}/{e.name}" for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)
            )

    for aa in subdirs(fp):
        yield from subdirs(aa)


def _leaf_keys(tree: StorageTree, leaf: str) -> dict[bytes, set[int]]:
    ranks: dict[bytes, set[int]] = {}
    with tree.entries(leaf) as entries:
        for e in entries:
            parsed = kvfile.parse_name(e.name)
            if parsed is not None:
                ranks.setdefault(parsed[0], set()).add(parsed[1])
    return ranks


def export_pack(
    storage: str,
    fingerprint: str,
    out: str,
    known: NamespaceInfo | None = None,
    model: dict[str, Any] | None = None,
    overwrite: bool = False,
    name: str = "",
) -> ExportReport:
    """Write the complete, verified blocks of namespace ``fingerprint`` under ``storage`` into the
    pack ``out`` (written under a temporary name beside it, renamed at the end; mode 0600).

    ``known``: the namespace as a running server describes it (its layout then decides which
    files fit; else the first block's header does). ``model``: the model identity to record;
    ``name``: the namespace's name, when ``known`` has none.
    Files are read directly, so no server is needed; a corrupt file is left out and left in
    place (a server quarantines it when it reads it). Raises :class:`PackError` when the
    namespace has no complete block, FileExistsError when ``out`` exists and not ``overwrite``."""
    if not _FP_RE.match(fingerprint):
        raise PackError(f"namespace {fingerprint!r} is not a fingerprint (32 lowercase hex digits)")
    if not overwrite and os.path.lexists(out):
        raise FileExistsError(errno.EEXIST, "the pack exists already (--force replaces it)", out)
    if not StorageTree.check(storage):
        raise PackError(f"the storage directory {storage} does not exist: nothing to export")
    tree = StorageTree.open(storage)
    tmp = f"{out}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if known is not None and name and not known.name:
            known.name = name
        ex = _Exporter(
            tree, fingerprint, known, fd, ExportReport(out, known or NamespaceInfo(fingerprint, 0, 0, name))
        )
        try:
            ex.walk()
            ex.finish(model, storage)
            os.close(fd)
            fd = -1
            os.rename(tmp, out)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        finally:
            ex.close()
    finally:
        tree.close()
    ex.report.bytes = os.stat(out).st_size
    return ex.report


class _Exporter:
    """One export: the walk of the namespace's tree, streaming each complete, verified block into
    the pack file ``fd`` (one KV file image in memory at a time), then the manifest and tail."""

    MAX_PROBLEMS = 8  # the first few problems are told to the user; all are counted

    def __init__(
        self, tree: StorageTree, fp: str, known: NamespaceInfo | None, fd: int, report: ExportReport
    ):
        self.tree, self.fp, self.ns, self.fd, self.report = tree, fp, known, fd, report
        self.name = report.namespace.name
        self.keys: list[bytes] = []
        self.crcs: list[list[int]] = []
        self.pos = HEAD_BYTES
        self._hdr = mmap.mmap(-1, kvfile.HEADER_BYTES)
        self.buf: _FileBuf | None = None

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()
        self._hdr.close()

    def problem(self, text: str) -> None:
        if len(self.report.problems) < self.MAX_PROBLEMS:
            self.report.problems.append(text)

    def walk(self) -> None:
        _write_all(self.fd, PACK_MAGIC + struct.pack("<I", PACK_VERSION) + bytes(HEAD_BYTES - 12), 0)
        for leaf in _leaves(self.tree, self.fp):
            for key, ranks in sorted(_leaf_keys(self.tree, leaf).items()):
                if self.ns is None:
                    layout = _pick_layout(self.tree, self.fp, leaf, key, memoryview(self._hdr))
                    if layout is None:
                        continue
                    self.ns = self.report.namespace = NamespaceInfo(self.fp, *layout, name=self.name)
                if not ranks >= set(range(self.ns.world_size)):
                    self.report.skipped_incomplete += 1
                    continue
                if self.buf is None:
                    self.buf = _FileBuf(kvfile.file_size(self.ns.shard_bytes))
                crcs = self._block(self.ns, leaf, key, self.buf.view)
                if crcs is not None:
                    self.keys.append(key)
                    self.crcs.append(crcs)
                    self.pos += len(self.buf.view) * self.ns.world_size

    def _block(self, ns: NamespaceInfo, leaf: str, key: bytes, img: memoryview) -> list[int] | None:
        """Copy every rank's file of ``key`` into the pack at ``pos``, verified on the way; their
        payload CRCs, or None when the block is left out (the next one is written at the same
        ``pos``)."""
        crcs = []
        for rank in range(ns.world_size):
            name = kvfile.file_name(key, rank)
            where = self.tree.rel_path(leaf, name)
            try:
                fd = self.tree.open_file(leaf, name, os.O_RDONLY)
            except FileNotFoundError:
                self.report.skipped_other += 1
                self.problem(f"{where}: vanished during the export")
                return None
            try:
                size = os.fstat(fd).st_size
                ok = size == len(img) and _read_exact(fd, img, 0) == len(img)
            finally:
                os.close(fd)
            if not ok:
                self.report.skipped_other += 1
                self.problem(f"{where}: {size} bytes, not the {len(img)} of this layout")
                return None
            try:
                crcs.append(check_image(img, ns, key, rank))
            except CorruptFile as exc:
                self.report.skipped_corrupt += 1
                self.problem(f"{where}: {exc}")
                return None
            _write_all(self.fd, img, self.pos + rank * len(img))
        return crcs

    def finish(self, model: dict[str, Any] | None, storage: str) -> None:
        ns, keys = self.ns, self.keys
        if ns is None or not keys:
            raise PackError(f"namespace {self.fp} has no complete block under {storage}: nothing to export")
        file_bytes = kvfile.file_size(ns.shard_bytes)
        manifest = json.dumps(
            _manifest(ns, model, keys, self.crcs, file_bytes), separators=(",", ":")
        ).encode()
        if len(manifest) > MAX_MANIFEST:
            raise PackError(
                f"{len(keys)} blocks make a manifest of {len(manifest)} bytes, over {MAX_MANIFEST}"
            )
        _write_all(self.fd, manifest, self.pos)
        _write_all(self.fd, _tail(self.pos, len(manifest), crc32c(manifest)), self.pos + len(manifest))
        os.fsync(self.fd)
        self.report.blocks = len(keys)
        self.report.files = len(keys) * ns.world_size


def _manifest(
    ns: NamespaceInfo, model: dict[str, Any] | None, keys: list[bytes], crcs: list[list[int]], file_bytes: int
) -> dict[str, Any]:
    return {
        "format": "hpkv-pack",
        "pack_version": PACK_VERSION,
        "kv_format_version": FORMAT_VERSION,
        "hpkv_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "namespace": {
            "fingerprint": ns.fingerprint,
            "name": ns.name,
            "world_size": ns.world_size,
            "shard_bytes": ns.shard_bytes,
            "block_tokens": ns.block_tokens,
        },
        "model": model,
        "checksum": "crc32c",
        "data_offset": HEAD_BYTES,
        "file_bytes": file_bytes,
        "blocks": len(keys),
        "files": len(keys) * ns.world_size,
        "bytes": len(keys) * ns.world_size * file_bytes,
        "keys": [[k.hex(), c] for k, c in zip(keys, crcs, strict=True)],
    }


def _tail(offset: int, length: int, crc: int) -> bytes:
    raw = bytearray(_TAIL.pack(TAIL_MAGIC, PACK_VERSION, 0, offset, length, crc, 0))
    struct.pack_into("<I", raw, _TAIL_CRC_AT, crc32c(raw))
    return bytes(raw)


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# ------------------------------------------------------------------ reading a pack
def read_manifest(f: BinaryIO, size: int) -> Manifest:
    """The pack's manifest, its structure and bounds checked (not yet the KV files)."""
    if size < HEAD_BYTES + TAIL_BYTES:
        raise PackError(f"{size} bytes: too short for a pack (truncated, or not a pack)")
    f.seek(0)
    head = f.read(12)
    if head[:8] != PACK_MAGIC:
        raise PackError(f"not an hpkv pack (magic {head[:8]!r})")
    (version,) = struct.unpack("<I", head[8:12])
    if version != PACK_VERSION:
        raise PackError(f"pack version {version}; this hpkv reads version {PACK_VERSION}")
    f.seek(size - TAIL_BYTES)
    raw = bytearray(f.read(TAIL_BYTES))
    magic, tversion, _, m_off, m_len, m_crc, t_crc = _TAIL.unpack(raw)
    struct.pack_into("<I", raw, _TAIL_CRC_AT, 0)
    if magic != TAIL_MAGIC or crc32c(raw) != t_crc:
        raise PackError("the pack's tail is missing or damaged (truncated or corrupt pack)")
    if tversion != PACK_VERSION:
        raise PackError(f"pack version {tversion}; this hpkv reads version {PACK_VERSION}")
    if m_len > MAX_MANIFEST:
        raise PackError(f"manifest of {m_len} bytes, over the limit of {MAX_MANIFEST}")
    if m_off < HEAD_BYTES or m_off + m_len + TAIL_BYTES != size:
        raise PackError(f"manifest at {m_off}+{m_len} does not fit a pack of {size} bytes")
    f.seek(m_off)
    body = f.read(m_len)
    if len(body) != m_len or crc32c(body) != m_crc:
        raise PackError("manifest checksum mismatch (corrupt pack)")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # (RecursionError: nesting deeper than the parser's stack)
        raise PackError(f"the manifest is not JSON: {exc}") from None
    m = _parse_manifest(doc)
    if m.file_bytes * m.files + HEAD_BYTES != m_off:
        raise PackError(
            f"the manifest lists {m.files} files of {m.file_bytes} bytes, but the pack holds "
            f"{m_off - HEAD_BYTES} bytes of them"
        )
    return m


def _parse_manifest(doc: Any) -> Manifest:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise PackError(f"malformed manifest: {what}")

    def intval(v: Any, lo: int, hi: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    need(isinstance(doc, dict) and doc.get("format") == "hpkv-pack", "not an hpkv pack manifest")
    need(doc.get("pack_version") == PACK_VERSION, f"pack version {doc.get('pack_version')!r}")
    if doc.get("kv_format_version") != FORMAT_VERSION:
        raise PackError(
            f"the pack holds KV files of format version {doc.get('kv_format_version')!r}; this hpkv "
            f"reads version {FORMAT_VERSION} (export it again with this hpkv's version)"
        )
    nsd = doc.get("namespace")
    need(isinstance(nsd, dict), "no namespace")
    fp = nsd.get("fingerprint")
    need(isinstance(fp, str) and bool(_FP_RE.match(fp)), "namespace fingerprint")
    world, shard = nsd.get("world_size"), nsd.get("shard_bytes")
    need(intval(world, 1, MAX_WORLD), f"world size {world!r}")
    need(intval(shard, 1, MAX_SHARD_BYTES), f"shard bytes {shard!r}")
    name, tokens = nsd.get("name", ""), nsd.get("block_tokens", 0)
    need(isinstance(name, str) and len(name) <= MAX_NAME, "namespace name")
    need(intval(tokens, 0, 1 << 30), "block tokens")
    model = doc.get("model")
    need(model is None or isinstance(model, dict), "model")
    file_bytes = kvfile.file_size(shard)
    need(doc.get("file_bytes") == file_bytes and doc.get("data_offset") == HEAD_BYTES, "file layout")
    entries = doc.get("keys")
    need(isinstance(entries, list), "no key list")
    keys: list[bytes] = []
    crcs: list[list[int]] = []
    for e in entries:
        need(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], list),
            "key entry",
        )
        need(len(e[0]) == 2 * KEY_BYTES and bool(_FP_RE.match(e[0])), f"key {e[0]!r}")
        need(len(e[1]) == world and all(intval(c, 0, 0xFFFFFFFF) for c in e[1]), f"checksums of key {e[0]}")
        keys.append(bytes.fromhex(e[0]))
        crcs.append(e[1])
    need(len(set(keys)) == len(keys), "a key listed twice")
    n = len(keys)
    need(doc.get("blocks") == n, "block count")
    need(doc.get("files") == n * world, "file count")
    need(doc.get("bytes") == n * world * file_bytes, "byte count")
    ns = NamespaceInfo(fp, world, shard, name, tokens)
    return Manifest(ns, model, keys, crcs, file_bytes, doc)


def _images(f: BinaryIO, m: Manifest, buf: _FileBuf) -> Iterator[tuple[int, bytes, int, memoryview]]:
    """(block index, key, rank, verified image) of every KV file in the pack, in order."""
    fd = f.fileno()
    pos = HEAD_BYTES
    for i, (key, crcs) in enumerate(zip(m.keys, m.crcs, strict=True)):
        for rank in range(m.namespace.world_size):
            if _read_exact(fd, buf.view, pos) != m.file_bytes:
                raise PackError(f"block {i} ({key.hex()}) rank {rank}: short read (truncated pack)")
            try:
                check_image(buf.view, m.namespace, key, rank, crcs[rank])
            except CorruptFile as exc:
                raise PackError(f"block {i} ({key.hex()}) rank {rank} at offset {pos}: {exc}") from None
            yield i, key, rank, buf.view
            pos += m.file_bytes


# ------------------------------------------------------------------ import
def import_pack(
    pack: str,
    storage: str,
    expect_namespace: str | None = None,
    expect_model: dict[str, Any] | None = None,
    fsync: bool = False,
    dry_run: bool = False,
    journal_node: str | None = None,
) -> ImportReport:
    """Verify the whole pack, then write its blocks under ``storage`` and journal them.

    Refuses (:class:`PackMismatch`) a pack whose namespace is not ``expect_namespace`` or whose
    recorded model identity is not ``expect_model``, when given; (:class:`PackError`) a pack
    that is malformed or corrupt anywhere. Either way before anything is written. ``dry_run``:
    verify only."""
    with open(pack, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        m = read_manifest(f, size)
        ns = m.namespace
        if expect_namespace is not None and not _names(expect_namespace, ns.fingerprint):
            raise PackMismatch(
                f"the pack holds namespace {ns.fingerprint} ({ns.name or 'unnamed'}), not {expect_namespace}"
            )
        if expect_model is not None:
            if m.model is None or "identity" not in m.model:
                raise PackMismatch(
                    "the pack does not record its model (it was exported without --model): "
                    "cannot check it against --expect-model"
                )
            if m.model["identity"] != expect_model:
                raise PackMismatch(
                    f"the pack is for another model: it records {json.dumps(m.model['identity'])} "
                    f"({m.model.get('path', '?')}), the expected model is {json.dumps(expect_model)}"
                )
        report = ImportReport(pack, ns, m.model, blocks=len(m.keys), dry_run=dry_run)
        buf = _FileBuf(m.file_bytes)
        try:
            for _ in _images(f, m, buf):  # the whole pack, before anything is written
                report.verified_bytes += m.file_bytes
            if dry_run:
                return report
            _write_blocks(f, m, buf, storage, fsync, report, journal_node)
        finally:
            buf.close()
    return report


def _names(given: str, fp: str) -> bool:
    """``--namespace`` names ``fp``: the fingerprint, or a prefix of at least 8 digits of it."""
    return given == fp or (len(given) >= 8 and fp.startswith(given))


def _write_blocks(
    f: BinaryIO,
    m: Manifest,
    buf: _FileBuf,
    storage: str,
    fsync: bool,
    report: ImportReport,
    journal_node: str | None,
) -> None:
    ns = m.namespace
    tree = StorageTree.open(storage)  # the server's checks: private, safe ancestors; made 0700
    # The IO workers' writer, fed from our buffer as its "pool": the payload sits at offset 4096
    # of the image (page-aligned); it rebuilds the same header (a new creation time).
    io = KvFileIO(tree, buf.view, o_direct=False, fsync=fsync)
    raw_ns = kvfile.fingerprint_bytes(ns.fingerprint)
    try:
        # Files no journal lists (an hpkv before journals, a copy by hand) are found by the scan a
        # namespace without journals gets at attach; a first journal here would skip that scan.
        journal = JournalReader(tree, ns.fingerprint).exists() or not _has_subdirs(tree, ns.fingerprint)
        # Read and verified again as written: the pack may have changed since the first pass.
        # A failure here leaves the blocks written so far, each file complete and valid.
        for _, key, rank, _img in _images(f, m, buf):
            written, existed = io.write(
                ns.fingerprint, BlockId(raw_ns, key, rank, ns.world_size), kvfile.HEADER_BYTES, ns.shard_bytes
            )
            if existed:
                report.files_present += 1
            else:
                report.files_written += 1
                report.bytes_written += written
        if journal:
            report.journal = _journal(tree, m, journal_node)
    finally:
        io.close()
        tree.close()


def _has_subdirs(tree: StorageTree, fp: str) -> bool:
    with tree.entries(fp) as entries:
        return any(len(e.name) == 2 and e.is_dir(follow_symlinks=False) for e in entries)


def import_node() -> str:
    """The journal name imports on this host write under (never a server's node id)."""
    return "import-" + node_id("/hpkv-import")


def _journal(tree: StorageTree, m: Manifest, node: str | None) -> str:
    """ADD records of the pack's blocks in this host's import journal of the namespace: running
    servers find them at their next poll, a later attach without a scan, the evictor counts
    them. Imports on one host take turns on it (a lock file beside it)."""
    ns = m.namespace
    node = node or import_node()
    rel = journal_dir(ns.fingerprint)
    with tree.dir(rel, create=True) as dfd:
        lock = os.open(
            f".{node}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
        )
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        w = JournalWriter(tree, ns.fingerprint, node)
        try:
            w.ensure_open()  # what the journal held (earlier imports), rewritten as a snapshot
            # blocks it listed already get the new time: recently wanted, for the evictor
            adds = Adds(ns.world_size, time.time_ns(), b"".join(m.keys), ns.world_size * m.file_bytes)
            w.apply_adds(adds)
            w.append([adds])
        finally:
            w.close()
    finally:
        os.close(lock)
    return tree.rel_path(rel, node + SUFFIX)
