"""Keys and namespaces: the one place that says which bytes belong together.

A *namespace* fingerprints everything that changes the bytes of a KV page (model
identity, see :mod:`hpkv.protocol.model_identity`; dtypes, block size, layer count and
page size, TP/PP size, layout, CPU attention ISA, engine and version, hpkv format and
namespace versions). Bytes written under one namespace are never loaded under another,
because every block key is derived from the fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

#: Bumped when the pool slot or KV file layout changes: old files stop matching (the KV file
#: header carries it, and a file of another version is refused as corrupt).
FORMAT_VERSION = 1
#: Bumped when what a namespace fingerprints changes meaning, so namespaces written before stop
#: matching while their files stay valid files of another namespace (never read, never refused).
#: 2: the model is named by its content, not its path and mtimes (hpkv.protocol.model_identity).
NAMESPACE_VERSION = 2
KEY_BYTES = 16


def namespace_fingerprint(spec: Mapping[str, Any]) -> str:
    """Stable 32-hex-digit fingerprint of a namespace description (order-insensitive)."""
    canonical = json.dumps(
        {**spec, "hpkv_format": FORMAT_VERSION, "hpkv_namespace": NAMESPACE_VERSION},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def _hash_bytes(block_hash: bytes | int) -> bytes:
    if isinstance(block_hash, int):
        return block_hash.to_bytes(32, "little", signed=block_hash < 0)
    return block_hash


def block_keys(fingerprint: str, block_hashes: Sequence[bytes | int], group: int = 0) -> list[bytes]:
    """The index keys of engine blocks (all TP shards of a block share its key).

    ``group``: the engine's KV cache group (hybrid models keep one per attention kind, each
    with its own blocks for the same token positions). It salts the hash; group 0's salt is
    blake2b's default (zeros), so single-group keys are the keys hpkv always wrote."""
    fp = bytes.fromhex(fingerprint)
    salt = group.to_bytes(16, "little")  # blake2b's salt is at most 16 bytes
    return [
        hashlib.blake2b(_hash_bytes(bh), digest_size=KEY_BYTES, key=fp, salt=salt).digest()
        for bh in block_hashes
    ]


def block_key(fingerprint: str, block_hash: bytes | int) -> bytes:
    return block_keys(fingerprint, [block_hash])[0]


def namespaces_named(sel: str, known: Sequence[tuple[int, str, str]]) -> list[int]:
    """The positions in ``known`` ((id, fingerprint, name) of each namespace) that ``sel``
    names, as `hpkv status` shows them: the namespace of that id (all digits), else those of
    that name, else those whose fingerprint starts with it (hex). Digits that are no id are a
    fingerprint prefix too: a fingerprint's first 12 characters are all digits once in ~280."""
    sel = sel.strip()
    if sel.isdigit():
        found = [i for i, (ns_id, _, _) in enumerate(known) if ns_id == int(sel)]
        if found:
            return found
    found = [i for i, (_, _, name) in enumerate(known) if name == sel]
    if not found and sel and all(c in "0123456789abcdef" for c in sel.lower()):
        found = [i for i, (_, fp, _) in enumerate(known) if fp.startswith(sel.lower())]
    return found
