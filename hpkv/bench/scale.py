"""``hpkv bench scale``: what the server's catalog of stored blocks costs as it grows.

For each N (``--n``), N KV files are created for random keys of one namespace (sparse:
a real 4096-byte header, then a hole up to the file's full size, 3.5 MiB of payload by
default), a private ``hpkv serve`` is started on that storage directory, and the
namespace is attached, which starts the server's scan of it. Lookups are issued
without pause from the attach on, alternating 128-key *hits* (random keys that have
files) and 128-key *misses* (random keys that have none). Reported per N:

* bytes of server memory per stored block: the server's private resident memory (RssAnon)
  once the scan's finds are journaled (the namespace's journal holds all N records, and
  RssAnon has settled: the flush's temporary buffers are freed), less the same before the
  attach, over N; also at the scan's log line (``bytes_per_block_scan_end``), when the
  journal's buffers may still be held;
* the scan rate: N over the scan's duration (from the server's log line);
* attach-to-first-hit: from the attach call to the end of the first lookup that reported
  a storage hit;
* lookup latency p50/p99 of hits and misses, during the scan and after it (client
  round trip, this process to the server). A storage hit's files are stat-ed when a lookup
  has not seen them for 2 s, so random hits after the scan pay up to 128 stats; the same
  128 keys looked up again and again (``hit_verified``) pay none: the catalog's own cost.

The files are created warm (their directory entries are in the page cache), as they are
on a server that restarts on a node that wrote them; the files are removed at the end.
``--json`` prints one object; the text output ends with the 10^7 extrapolation of the
memory per block and scan time from the two largest N.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import time
import uuid
from typing import Any

LOOKUP_KEYS = 128
WARM_BLOCKS = 256  # a first namespace's, before the measured one
SCAN_TIMEOUT_S = 900.0
JOURNAL_TIMEOUT_S = 120.0  # from the scan's log line to its finds in the journal
SETTLE_S = 0.2  # RssAnon settled: unchanged over this long (at most SETTLE_TRIES times)
SETTLE_TRIES = 25
_SCAN_LOG = re.compile(
    r"scan of namespace (\d+) \(\w+\): (\d+) complete block\(s\) from (\d+) file\(s\) in ([\d.]+)s"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", default="10000,100000,1000000", help="stored blocks per run, comma-separated")
    p.add_argument(
        "--dir",
        default="/var/tmp/hpkv-bench-scale",
        help="storage directory on a real disk; removed afterwards (default %(default)s)",
    )
    p.add_argument(
        "--shard-mib", type=float, default=3.5, help="payload MiB of one file (sparse; default %(default)s)"
    )
    p.add_argument("--lookups", type=int, default=2000, help="timed lookups of each kind after the scan")
    p.add_argument(
        "--no-headers",
        action="store_true",
        help="create the files empty (right name and size, no header): no data block each, so a "
        "million of them are created and removed much faster; the scan and lookups never read them",
    )


def _rss(pid: int) -> int:
    """The process's private resident memory (RssAnon): not the pool and stats mappings it
    shares, whose resident pages come and go with what the other processes touch."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(len(s) * q))] * 1e6, 1)


def make_files(
    storage: str, fingerprint: str, keys: list[bytes], shard_bytes: int, headers: bool = True
) -> None:
    """One rank-0 KV file per key, as an IO worker writes it: a valid header, then a hole
    (the payload reads as zeros, which is what the header's checksum is of); without
    ``headers``, a hole of the file's size."""
    from hpkv.io_workers import kvfile
    from hpkv.io_workers.checksum import crc32c

    payload_crc = crc32c(memoryview(bytearray(shard_bytes)))
    size = kvfile.file_size(shard_bytes)
    ns_raw = kvfile.fingerprint_bytes(fingerprint)
    hdr = memoryview(bytearray(kvfile.HEADER_BYTES))
    made: set[str] = set()
    for key in keys:
        d = os.path.join(storage, kvfile.rel_dir(fingerprint, key))
        if d not in made:
            os.makedirs(d, mode=0o700, exist_ok=True)
            made.add(d)
        kvfile.pack_header(hdr, kvfile.BlockId(ns_raw, key, 0, 1), shard_bytes, payload_crc)
        fd = os.open(os.path.join(d, kvfile.file_name(key, 0)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if headers:
                os.write(fd, hdr)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


def _scan_seconds(log: str, ns_id: int) -> float | None:
    for m in _SCAN_LOG.finditer(log):
        if int(m.group(1)) == ns_id:
            return float(m.group(4))
    return None


def _timed(client: Any, ns_id: int, keys: list[bytes], into: list[float]) -> int:
    """One lookup, its round trip appended to ``into``; returns the hit count."""
    return _probed(client, ns_id, keys, into)[0]


def _probed(client: Any, ns_id: int, keys: list[bytes], into: list[float]) -> tuple[int, bool]:
    """:func:`_timed`, and whether the lookup ended at a block still being checked on storage
    (answered at HPKV_STORAGE_LOOKUP_WAIT_MS: an engine asks again)."""
    t = time.perf_counter()
    hit, _, unconfirmed = client.probe(ns_id, keys)
    into.append(time.perf_counter() - t)
    return hit, unconfirmed


def _journaled(storage: str, fingerprint: str, n: int) -> float:
    """Wait until the namespace's journals hold ``n`` records (the server journals what its
    scan found on its storage thread, after the scan's log line); returns the seconds waited."""
    from hpkv.engine.storage import journal

    d = os.path.join(storage, journal.journal_dir(fingerprint))
    want = journal.HEADER_BYTES + n * journal.RECORD_BYTES
    t0 = time.perf_counter()
    while True:
        with contextlib.suppress(FileNotFoundError):
            have = sum(e.stat().st_size for e in os.scandir(d) if e.name.endswith(journal.SUFFIX))
            if have >= want:
                return time.perf_counter() - t0
        if time.perf_counter() - t0 > JOURNAL_TIMEOUT_S:
            raise TimeoutError(f"{d}: fewer than {n} records {JOURNAL_TIMEOUT_S:g} s after the scan")
        time.sleep(0.02)


def _settled_rss(pid: int) -> int:
    """RssAnon once two readings :data:`SETTLE_S` apart agree (or the last of SETTLE_TRIES)."""
    last = _rss(pid)
    for _ in range(SETTLE_TRIES):
        time.sleep(SETTLE_S)
        now = _rss(pid)
        if now == last:
            break
        last = now
    return last


def _misses() -> list[bytes]:
    return [os.urandom(16) for _ in range(LOOKUP_KEYS)]


def _during_scan(client: Any, srv: Any, ns_id: int, hit_keys: Any, lat: dict, t_attach: float) -> tuple:
    """Hits and misses, alternating, until the scan's log line: (scan seconds, first hit)."""
    first_hit = None
    next_poll = 0.0
    while True:
        now = time.perf_counter()
        if now >= next_poll:
            scan_s = _scan_seconds(srv.log(), ns_id)
            if scan_s is not None:
                return scan_s, first_hit
            next_poll = time.perf_counter() + 0.05
            if now - t_attach > SCAN_TIMEOUT_S:
                raise TimeoutError(f"the scan did not end within {SCAN_TIMEOUT_S:g} s")
        if _timed(client, ns_id, hit_keys(), lat["hit_during"]) and first_hit is None:
            first_hit = time.perf_counter() - t_attach
        _timed(client, ns_id, _misses(), lat["miss_during"])


def measure(n: int, root: str, shard_bytes: int, lookups: int, headers: bool = True) -> dict[str, Any]:
    """One N: create the files, start a server, attach, measure, stop; the files stay."""
    from hpkv.client import connect
    from hpkv.protocol.keys import namespace_fingerprint
    from hpkv.testing.server import ServerProcess, private_env

    storage = os.path.join(root, f"n{n}")
    fp = namespace_fingerprint({"bench": "scale", "n": n, "run": uuid.uuid4().hex})
    keys = [os.urandom(16) for _ in range(n)]
    t0 = time.perf_counter()
    make_files(storage, fp, keys, shard_bytes, headers)
    create_s = time.perf_counter() - t0
    warm_fp = namespace_fingerprint({"bench": "scale-warm", "run": uuid.uuid4().hex})
    warm_keys = [os.urandom(16) for _ in range(WARM_BLOCKS)]
    make_files(storage, warm_fp, warm_keys, shard_bytes)

    srv = ServerProcess(private_env(pool_size="64m", storage=storage, HPKV_LOG_LEVEL="INFO"))
    srv.start()
    assert srv.proc is not None
    pid = srv.proc.pid
    try:
        client = connect(srv.cfg, spawn=False, call_timeout=60.0)
        # A small namespace first, scanned and looked up: whatever the server sets up on its
        # first attach, scan and lookups is not counted as the catalog's.
        warm = client.attach_namespace(warm_fp, 1, shard_bytes)
        while _scan_seconds(srv.log(), warm.ns_id) is None:
            time.sleep(0.02)
        for _ in range(20):
            client.lookup(warm.ns_id, warm_keys[:LOOKUP_KEYS])
            client.lookup(warm.ns_id, _misses())
        _journaled(storage, warm_fp, WARM_BLOCKS)
        rss0 = _settled_rss(pid)

        def hit_keys() -> list[bytes]:
            return [keys[i] for i in _randints(n, LOOKUP_KEYS)]

        lat: dict[str, list[float]] = {
            "hit_during": [],
            "miss_during": [],
            "hit_after": [],
            "miss_after": [],
            "hit_verified": [],
        }
        t_attach = time.perf_counter()
        ns = client.attach_namespace(fp, 1, shard_bytes, name=f"bench-scale-{n}")
        scan_s, first_hit = _during_scan(client, srv, ns.ns_id, hit_keys, lat, t_attach)
        seen_done = time.perf_counter() - t_attach
        stored = int(client.stats()["storage"]["files"]) - WARM_BLOCKS  # the measured namespace's
        rss_scan = _rss(pid)
        journal_s = _journaled(storage, fp, stored)
        rss1 = _settled_rss(pid)
        full = unconfirmed = 0
        for _ in range(lookups):
            hit, pending = _probed(client, ns.ns_id, hit_keys(), lat["hit_after"])
            full += hit == LOOKUP_KEYS
            unconfirmed += pending
            if first_hit is None and hit:
                first_hit = time.perf_counter() - t_attach
            _timed(client, ns.ns_id, _misses(), lat["miss_after"])
        same = hit_keys()  # the same keys again and again: verified within the last 2 s, no stat
        client.lookup(ns.ns_id, same)
        for _ in range(lookups):
            _timed(client, ns.ns_id, same, lat["hit_verified"])
        rss2 = _rss(pid)
        client.close()
    finally:
        srv.stop()
        srv.cleanup()
    out: dict[str, Any] = {
        "n": n,
        "create_s": round(create_s, 2),
        "bytes_per_block": round((rss1 - rss0) / n, 1),
        "bytes_per_block_scan_end": round((rss_scan - rss0) / n, 1),
        "journal_after_scan_s": round(journal_s, 3),
        "bytes_per_block_after_lookups": round((rss2 - rss0) / n, 1),
        "scan_s": round(scan_s, 3),
        "scan_files_per_s": round(n / scan_s) if scan_s else None,
        "scan_seen_done_s": round(seen_done, 3),
        "attach_to_first_hit_ms": round(first_hit * 1e3, 2) if first_hit is not None else None,
        "stored_files": stored,
        "full_hits_after": full,
        "unconfirmed_after": unconfirmed,
        "lookups_during_scan": len(lat["hit_during"]),
    }
    for kind, values in lat.items():
        out[f"{kind}_p50_us"] = _pct(values, 0.5)
        out[f"{kind}_p99_us"] = _pct(values, 0.99)
    return out


def _randints(n: int, k: int) -> list[int]:
    return [int.from_bytes(os.urandom(4), "little") % n for _ in range(k)]


def extrapolate(rows: list[dict[str, Any]], target: int = 10_000_000) -> dict[str, Any] | None:
    """Memory and scan time at ``target`` blocks from the slope between the two largest N."""
    if len(rows) < 2:
        return None
    a, b = sorted(rows, key=lambda r: r["n"])[-2:]
    mem_slope = (b["bytes_per_block"] * b["n"] - a["bytes_per_block"] * a["n"]) / (b["n"] - a["n"])
    scan_slope = (b["scan_s"] - a["scan_s"]) / (b["n"] - a["n"])
    return {
        "n": target,
        "bytes_per_block": round(mem_slope, 1),
        "server_mib": round(mem_slope * target / 2**20),
        "scan_s": round(b["scan_s"] + scan_slope * (target - b["n"]), 1),
    }


def run(args: argparse.Namespace) -> int:
    sizes = [int(float(x)) for x in args.n.split(",") if x.strip()]
    shard = int(args.shard_mib * 2**20)
    root = os.path.join(args.dir, f"run-{uuid.uuid4().hex[:8]}")
    rows = []
    try:
        for n in sizes:
            try:
                rows.append(measure(n, root, shard, args.lookups, not args.no_headers))
            finally:
                shutil.rmtree(os.path.join(root, f"n{n}"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(args.dir)  # when empty: nothing else of anyone's was in it
    ext = extrapolate(rows)
    if args.json:
        print(
            json.dumps({"shard_bytes": shard, "lookup_keys": LOOKUP_KEYS, "runs": rows, "extrapolated": ext})
        )
        return 0
    print(
        f"hpkv bench scale: one namespace, N sparse KV files of {args.shard_mib:g} MiB payload, random keys; "
        f"{LOOKUP_KEYS}-key lookups (client round trip), hits and misses alternating"
    )
    print(
        f"{'N':>9} {'B/block':>8} {'(scan end)':>10} {'scan/s':>9} {'1st hit ms':>10} "
        f"{'hit p50/p99 us (scan)':>22} {'miss p50/p99 (scan)':>20} {'hit p50/p99 (after)':>20} "
        f"{'miss p50/p99 (after)':>21}"
    )
    for r in rows:
        print(
            f"{r['n']:>9} {r['bytes_per_block']:>8} {r['bytes_per_block_scan_end']:>10} "
            f"{r['scan_files_per_s'] or '-':>9} "
            f"{r['attach_to_first_hit_ms'] or '-':>10} "
            f"{_pair(r, 'hit_during'):>22} {_pair(r, 'miss_during'):>20} {_pair(r, 'hit_after'):>20} "
            f"{_pair(r, 'miss_after'):>21}"
        )
    if ext:
        print(
            f"10^7 blocks (slope of the two largest N): {ext['bytes_per_block']} B/block, "
            f"{ext['server_mib']} MiB of server memory, scan {ext['scan_s']} s"
        )
    print(
        "the same 128 keys again and again (verified, no stat) p50/p99 us: "
        + ", ".join(f"{r['n']}: {_pair(r, 'hit_verified')}" for r in rows)
    )
    print(f"lookups during the scan: {', '.join(str(r['lookups_during_scan']) for r in rows)} per kind")
    print(
        "hit lookups after the scan, full / ended at a block still being checked (asked again by "
        "an engine): " + ", ".join(f"{r['n']}: {r['full_hits_after']}/{r['unconfirmed_after']}" for r in rows)
    )
    return 0


def _pair(r: dict[str, Any], kind: str) -> str:
    return f"{r[f'{kind}_p50_us']}/{r[f'{kind}_p99_us']}"
