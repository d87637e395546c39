"""Validation of a ``register_device`` call's device spec, host memory or a CUDA KV cache: the
layout a transfer worker will address is checked here, in the server, against the real sizes
of the memory it names, before any worker is started for it."""

from __future__ import annotations

import os
import stat
from typing import Any

from hpkv.common.layout import pages_fit

MAX_REGIONS = 4096
MAX_LAYERS = 4096
MAX_STRIDE = 1 << 40  # bytes from one block's page to the next block's, in a layer
MAX_BLOCKS = 1 << 31
JOB_TIMEOUT_S = 30.0  # a job whose event or copy has not completed by then fails (the engine recomputes)
MAX_EVENTS = 1024
_HEX = set("0123456789abcdef")


def int_arg(msg: dict[str, Any], key: str, lo: int, hi: int, default: Any = ...) -> Any:
    """``msg[key]`` as an int in ``lo..hi`` (a JSON bool is not an int); ValueError naming it."""
    if key not in msg or msg[key] is None:
        if default is ...:
            raise ValueError(f"{key!r} is missing")
        return default
    v = msg[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{key}={str(v)[:40]!r} must be an integer in {lo}..{hi}")
    return v


def validate_region(i: int, r: Any, allowed_uids: set[int]) -> dict[str, Any]:
    """Region ``i`` of a register_device call: an existing regular file of the client's, and a
    size within the file's real size."""
    if not isinstance(r, dict) or not isinstance(r.get("path"), str) or not os.path.isabs(r["path"]):
        raise ValueError(f"region {i} must be an object with an absolute 'path'")
    try:
        st = os.stat(r["path"])
    except OSError as exc:
        raise ValueError(f"region {i} {r['path']}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"region {i} {r['path']} is not a regular file")
    if st.st_uid not in allowed_uids:
        raise ValueError(f"region {i} {r['path']} belongs to uid {st.st_uid}, not to the client")
    declared = r.get("size", st.st_size)
    if not isinstance(declared, int) or isinstance(declared, bool) or not 0 < declared <= st.st_size:
        raise ValueError(
            f"region {i} {r['path']}: size {str(declared)[:40]} must be 1..{st.st_size} (the file's real size)"
        )
    return {"path": r["path"], "size": declared}


def validate_device(msg: dict[str, Any], slot_bytes: int, allowed_uids: set[int]) -> dict[str, Any]:
    """The device layout of a register_device call, checked against the real sizes of its
    region files, so a transfer worker can never address memory outside them or write past a
    pool slot. Returns the spec fields (regions with their real sizes); ValueError says what
    is wrong."""
    regions = msg.get("regions")
    if not isinstance(regions, list) or not 1 <= len(regions) <= MAX_REGIONS:
        raise ValueError(f"regions must be a list of 1..{MAX_REGIONS} {{path, size}} objects")
    out_regions = [validate_region(i, r, allowed_uids) for i, r in enumerate(regions)]
    sizes = [r["size"] for r in out_regions]
    stride = int_arg(msg, "block_stride", 1, MAX_STRIDE)
    page = int_arg(msg, "page_bytes", 1, stride)
    num_blocks = int_arg(msg, "num_blocks", 1, MAX_BLOCKS)
    bases = msg.get("layer_bases")
    if not isinstance(bases, list) or not 1 <= len(bases) <= MAX_LAYERS:
        raise ValueError(f"layer_bases must be a list of 1..{MAX_LAYERS} [region, offset] pairs")
    if len(bases) * page > slot_bytes:
        raise ValueError(
            f"{len(bases)} layers x {page} B pages = {len(bases) * page} B do not fit the "
            f"namespace's {slot_bytes} B pool slot"
        )
    out_bases = []
    for j, lb in enumerate(bases):
        if not (
            isinstance(lb, (list, tuple))
            and len(lb) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in lb)
        ):
            raise ValueError(f"layer_bases[{j}] must be [region index, byte offset]")
        r, off = lb
        if not 0 <= r < len(sizes) or not pages_fit(off, sizes[r], num_blocks, stride, page):
            raise ValueError(
                f"layer {j}: region {r} offset {off} + {num_blocks} blocks x {stride} B stride "
                f"reaches past the region's {sizes[r] if 0 <= r < len(sizes) else '?'} bytes"
            )
        out_bases.append([r, off])
    return {
        "regions": out_regions,
        "layer_bases": out_bases,
        "block_stride": stride,
        "page_bytes": page,
        "num_blocks": num_blocks,
    }


def _hex(v: Any, nbytes: int, what: str) -> str:
    if not isinstance(v, str) or len(v) != 2 * nbytes or not set(v) <= _HEX:
        raise ValueError(f"cuda.{what} must be {2 * nbytes} lowercase hex digits, got {str(v)[:40]!r}")
    return v


def _nonneg(c: dict[str, Any], key: str, hi: int) -> int:
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise ValueError(f"{key}={str(v)[:40]!r} must be an integer in 0..{hi}")
    return v


def validate_cuda(msg: dict[str, Any], slot_bytes: int, allowed_uids: set[int]) -> dict[str, Any]:
    """The spec of a CUDA ``register_device`` call; ValueError names the bad value."""
    c = msg.get("cuda")
    if not isinstance(c, dict) or c.get("driver") not in ("cuda", "host"):
        raise ValueError("cuda must be an object with driver 'cuda' or 'host'")
    if c["driver"] == "host":
        spec = validate_device(msg, slot_bytes, allowed_uids)
        if len(spec["regions"]) != 1:
            raise ValueError("a host-driver CUDA device has one region (its whole KV allocation)")
        n = _nonneg(c, "num_events", MAX_EVENTS)
        ev = validate_device(
            {"regions": [{"path": c.get("events"), "size": max(8 * n, 8)}], "layer_bases": [[0, 0]],
             "block_stride": 8, "page_bytes": 8, "num_blocks": 1},
            1 << 40, allowed_uids,
        )  # fmt: skip
        spec["cuda"] = {"driver": "host", "events": ev["regions"][0]["path"], "num_events": n}
        spec["cuda"]["job_timeout_s"] = _timeout(c)
        return spec
    alloc_bytes = _nonneg(c, "alloc_bytes", 1 << 50)
    events = c.get("events")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise ValueError(f"cuda.events must be a list of at most {MAX_EVENTS} event handles")
    spec = _check_spans(msg, slot_bytes, alloc_bytes)
    spec["cuda"] = {
        "driver": "cuda",
        "uuid": _hex(c.get("uuid"), 16, "uuid"),
        "mem_handle": _hex(c.get("mem_handle"), 64, "mem_handle"),
        "alloc_offset": _nonneg(c, "alloc_offset", 1 << 50),
        "alloc_bytes": alloc_bytes,
        "events": [_hex(e, 64, f"events[{i}]") for i, e in enumerate(events)],
        "job_timeout_s": _timeout(c),
    }
    return spec


def _timeout(c: dict[str, Any]) -> float:
    v = c.get("job_timeout_s", JOB_TIMEOUT_S)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.1 <= v <= 600:
        raise ValueError(f"cuda.job_timeout_s={str(v)[:40]!r} must be 0.1..600 seconds")
    return float(v)


def _check_spans(msg: dict[str, Any], slot_bytes: int, alloc_bytes: int) -> dict[str, Any]:
    """Every layer's pages lie inside the engine's buffer and one block fits a pool slot."""
    stride = _nonneg(msg, "block_stride", MAX_STRIDE)
    page = _nonneg(msg, "page_bytes", stride)
    num_blocks = _nonneg(msg, "num_blocks", MAX_BLOCKS)
    bases = msg.get("layer_bases")
    if not page or not num_blocks or not isinstance(bases, list) or not 1 <= len(bases) <= MAX_LAYERS:
        raise ValueError(f"page_bytes, num_blocks and 1..{MAX_LAYERS} layer_bases [0, offset] are required")
    if len(bases) * page > slot_bytes:
        raise ValueError(
            f"{len(bases)} layers x {page} B pages do not fit the namespace's {slot_bytes} B slot"
        )
    out = []
    for j, lb in enumerate(bases):
        ok = isinstance(lb, (list, tuple)) and len(lb) == 2 and lb[0] == 0
        off = lb[1] if ok else None
        if (
            not isinstance(off, int)
            or isinstance(off, bool)
            or not pages_fit(off, alloc_bytes, num_blocks, stride, page)
        ):
            raise ValueError(
                f"layer_bases[{j}] = {str(lb)[:40]}: {num_blocks} blocks x {stride} B from there do not "
                f"fit the {alloc_bytes} B KV buffer"
            )
        out.append([0, off])
    return {
        "regions": [],
        "layer_bases": out,
        "block_stride": stride,
        "page_bytes": page,
        "num_blocks": num_blocks,
    }
