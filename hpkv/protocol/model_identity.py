"""The model's part of a namespace: which weights computed a KV page, wherever they lie.

A node of a fleet may keep the model at another path, or have copied or downloaded it
again; its blocks must still be found, and blocks of other weights never. So the identity
is the model's *content*, not its path or its files' times:

* ``HPKV_MODEL_ID`` (the operator's name for the weights), when set, is the identity;
* else, for a local model directory (or a hub model whose snapshot lies in the local
  Hugging Face cache), a digest of
  - every small file vLLM or SGLang reads besides the weights (``*.json``, ``*.model``,
    ``*.tiktoken``, ``*.txt``, ``*.jinja``, ``*.py`` at the top level: the config, the
    generation config, the tokenizer, remote code), hashed in full; of the weight indexes
    (``*.index.json``) only the one of the weight format in use;
  - the weight files of the format the engines load (``*.safetensors``, else ``*.bin``,
    else ``*.pt``/``*.pth``): name, size, and a sample of their bytes. A safetensors file's
    JSON header (every tensor's name, dtype, shape and offsets) is hashed in full, and the
    first and last 4 KiB of every tensor (of at most :data:`MAX_TENSORS_SAMPLED` tensors a
    model, evenly spread over its files, and at least 64 a file); other formats give their
    first and last MiB and 16 chunks of 64 KiB at fixed fractions of the file;
* else (a hub name with no local snapshot) the name and the revision, the commit hash
  when the engine knows it.

A fine-tune of the same architecture (same header, same sizes) changes the bytes of every
tensor it trained, so the samples differ: another namespace. Not caught: an edit that
leaves the first and last 4 KiB of every sampled tensor alone (a few rows in the middle of
one matrix), or a tensor left out by the cap (models of more than 8192 tensors, such as
large mixtures of experts). Operators who change weights that way name them with
``HPKV_MODEL_ID``.

Paths, mtimes, hidden files, sub-directories, READMEs and licences and weights of another
format are left out: two copies agree when they hold the same files of the kinds above. A
copy with one more of them (a full download beside an engine's partial one) is another
namespace, a miss and never a wrong hit, and so is a node where a file cannot be read (it
enters the identity as its error); ``HPKV_MODEL_ID`` joins such copies.

The digest is cached per process, keyed by the files' paths, sizes, mtimes and inodes: a
scheduler and its worker in one process hash once. A 7B model's 339 tensors cost about
700 small reads: 70 ms from a cold virtio disk, 5-13 ms from the page cache (where the
engine, having just loaded the weights, usually left them).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import struct
import threading
from typing import Any

log = logging.getLogger("hpkv.model_identity")

#: Part of the digest: bumped when what is hashed changes, so old identities stop matching.
CONTENT_SCHEME = "hpkv-model-content-1"
METADATA_SUFFIXES = (".json", ".model", ".tiktoken", ".txt", ".jinja", ".py")
WEIGHT_FORMATS = ((".safetensors",), (".bin",), (".pt", ".pth"))
INDEX_SUFFIX = ".index.json"
MAX_METADATA_BYTES = 256 << 20  # larger "metadata" is sampled like weights
TENSOR_SAMPLE = 4096
MAX_TENSORS_SAMPLED = 8192  # per model, spread over its weight files
MIN_TENSORS_SAMPLED = 64  # per file, however many files
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit
EDGE_SAMPLE = 1 << 20
MID_SAMPLES, MID_SAMPLE = 16, 64 << 10


class ModelIdentityError(ValueError):
    """The model's identity cannot be derived (its directory cannot be listed)."""


def model_identity(
    model: str,
    *,
    model_id: str | None = None,
    revision: str | None = None,
    commit: str | None = None,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """The namespace entries that name the weights of ``model`` (a directory, a weight file,
    or a hub name); ``model_id`` (``HPKV_MODEL_ID``) replaces them. ``revision`` and
    ``commit`` (the resolved commit hash) matter only for a hub name; ``cache_dir`` is the
    engine's download directory, if not the Hugging Face default.

    Raises :class:`ModelIdentityError` if ``model`` is a directory that cannot be listed."""
    if model_id:
        return {"model_id": model_id}
    local = model if os.path.exists(model) else _hub_snapshot(model, commit or revision, cache_dir)
    if local is None:
        return {"model": model, "revision": commit or revision}
    return {"model_content": content_digest(local)}


# ------------------------------------------------------------------ the digest
_cache: dict[tuple[Any, ...], str] = {}
_cache_lock = threading.Lock()


def content_digest(path: str) -> str:
    """32 hex digits naming the content of the model directory (or single weight file) ``path``."""
    metadata, weights, stats = _select_files(path)
    key = (os.path.realpath(path), stats)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    entries: list[list[Any]] = [[CONTENT_SCHEME]]
    for name, p, size in metadata:
        entries.append([name, size, _whole_file_digest(p, size)])
    per_file = max(MIN_TENSORS_SAMPLED, MAX_TENSORS_SAMPLED // max(len(weights), 1))
    for name, p, size in weights:
        entries.append([name, size, _weight_sample_digest(p, size, per_file)])
    digest = hashlib.blake2b(json.dumps(entries).encode(), digest_size=16).hexdigest()
    with _cache_lock:
        _cache[key] = digest
    return digest


File = tuple[str, str, int]  # (name in the identity, path, size)


def _select_files(path: str) -> tuple[list[File], list[File], tuple[Any, ...]]:
    """The metadata and weight files that make the identity, and their stats (the cache key)."""
    if not os.path.isdir(path):  # one weight file (a GGUF model): its name is not content
        st = _stat(path)
        size = st.st_size if st else -1
        return [], [("", path, size)], (_stat_key("", st),)
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise ModelIdentityError(
            f"cannot list the model directory {path!r} ({exc.strerror}): its identity is its "
            "content; set HPKV_MODEL_ID to name the model instead"
        ) from None
    stats: dict[str, os.stat_result | None] = {}
    for name in names:
        if name.startswith("."):
            continue
        st = _stat(os.path.join(path, name))
        if st is None or _is_regular(st):  # a dangling link is recorded as its error
            stats[name] = st
    weight_suffixes = next((s for s in WEIGHT_FORMATS if any(n.endswith(s) for n in stats)), ())
    metadata, weights = [], []
    for name, st in stats.items():
        kind = _kind(name, weight_suffixes)
        size = st.st_size if st else -1
        if kind == "weights" or (kind == "metadata" and size > MAX_METADATA_BYTES):
            weights.append((name, os.path.join(path, name), size))
        elif kind == "metadata":
            metadata.append((name, os.path.join(path, name), size))
    key = tuple(_stat_key(n, stats[n]) for n in sorted(f[0] for f in metadata + weights))
    return metadata, weights, key


def _kind(name: str, weight_suffixes: tuple[str, ...]) -> str | None:
    """``"weights"``, ``"metadata"`` or None (not in the identity) for a file of a model directory
    whose weights end with ``weight_suffixes``."""
    if weight_suffixes and name.endswith(weight_suffixes):
        return "weights"
    if name.endswith(INDEX_SUFFIX):  # the index of the weights in use, not another format's
        in_use = bool(weight_suffixes) and name[: -len(INDEX_SUFFIX)].endswith(weight_suffixes)
        return "metadata" if in_use else None
    return "metadata" if name.endswith(METADATA_SUFFIXES) else None


def _stat(p: str) -> os.stat_result | None:
    try:
        return os.stat(p)
    except OSError:
        return None


def _is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def _stat_key(name: str, st: os.stat_result | None) -> tuple[Any, ...]:
    if st is None:
        return (name, None)
    return (name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _error_mark(exc: OSError) -> str:
    return "unreadable: " + errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _whole_file_digest(p: str, size: int) -> str:
    try:
        h = hashlib.blake2b(digest_size=16)
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()
    except OSError as exc:
        log.warning("model identity: cannot read %s (%s); it enters the identity as unreadable", p, exc)
        return _error_mark(exc)


def _weight_sample_digest(p: str, size: int, max_tensors: int) -> str:
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        log.warning("model identity: cannot open %s (%s); it enters the identity as unreadable", p, exc)
        return _error_mark(exc)
    try:
        h = hashlib.blake2b(digest_size=16)
        ranges = _safetensors_ranges(fd, size, max_tensors) if p.endswith(".safetensors") else None
        if ranges is None:
            h.update(b"chunks")
            ranges = _fixed_ranges(size)
        for start, length in ranges:
            h.update(struct.pack("<QQ", start, length))
            h.update(os.pread(fd, length, start))
        return h.hexdigest()
    except OSError as exc:
        log.warning("model identity: cannot read %s (%s); it enters the identity as unreadable", p, exc)
        return _error_mark(exc)
    finally:
        os.close(fd)


def _safetensors_ranges(fd: int, size: int, max_tensors: int) -> list[tuple[int, int]] | None:
    """The header and the first and last :data:`TENSOR_SAMPLE` bytes of each tensor, or None
    if the file is not a well-formed safetensors file (it is then sampled in fixed chunks)."""
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        return None
    (n,) = struct.unpack("<Q", head)
    if not 2 <= n <= min(MAX_SAFETENSORS_HEADER, size - 8):
        return None
    try:
        header = json.loads(os.pread(fd, n, 8))
        spans = sorted(
            (int(t["data_offsets"][0]), int(t["data_offsets"][1]))
            for k, t in header.items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    base = 8 + n
    if len(spans) > max_tensors:
        step = len(spans) / max_tensors
        spans = [spans[int(i * step)] for i in range(max_tensors)]
    ranges = [(0, base)]
    for b, e in spans:
        b, e = base + max(b, 0), min(base + max(e, 0), size)
        if e - b <= 2 * TENSOR_SAMPLE:
            if e > b:
                ranges.append((b, e - b))
        else:
            ranges += [(b, TENSOR_SAMPLE), (e - TENSOR_SAMPLE, TENSOR_SAMPLE)]
    return ranges


def _fixed_ranges(size: int) -> list[tuple[int, int]]:
    if size <= 2 * EDGE_SAMPLE + MID_SAMPLES * MID_SAMPLE:
        return [(0, max(size, 0))]
    ranges = [(0, EDGE_SAMPLE), (size - EDGE_SAMPLE, EDGE_SAMPLE)]
    span = size - 2 * EDGE_SAMPLE - MID_SAMPLE
    ranges += [(EDGE_SAMPLE + span * i // (MID_SAMPLES - 1), MID_SAMPLE) for i in range(MID_SAMPLES)]
    return ranges


# ------------------------------------------------------------------ hub models
def _hub_snapshot(name: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The local snapshot directory of hub model ``name`` at ``revision`` (a commit hash,
    branch or tag), if the Hugging Face cache holds its config; never goes to the network."""
    if not name or name.startswith(("/", ".")) or name.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # noqa: BLE001 - a malformed name or cache: identify by name
        return None
    return os.path.dirname(found) if isinstance(found, str) else None
