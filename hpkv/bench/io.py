"""``hpkv bench io``: KV file write/read throughput through the IO workers vs. a raw O_DIRECT loop.

Everything is measured in one run, so the ratios hold on a noisy shared machine.
A private ``hpkv serve`` (default ``HPKV_NUM_IO_WORKERS``, 2) with its storage tier
on a real disk (``--dir``, never tmpfs) writes and reads KV files of 128 KiB, 1 MiB
and 4 MiB payloads through the real path:

* write: ``commit`` of blocks whose bytes are in the pool → write-through spills by
  the IO workers, timed from the commit until the server counted every file;
* read: the DRAM copies are dropped (``clear``), then one ``promote`` of all the
  blocks, timed until the answer (files read into pool slots and checksummed).

The reference, run right after each of those repetitions, is one thread in this process
doing ``open(O_DIRECT) + pwritev + close`` of files of the same sizes in the same
directory layout (fresh names, like hpkv's), and ``open(O_DIRECT) + preadv + close``
of the very files hpkv wrote. O_DIRECT means reads come from the device; if the
storage refuses O_DIRECT, the page cache is dropped before every read instead.
Throughput is file bytes (4 KiB header + payload padded to 4 KiB) per second; the
write ratios are medians of per-repetition ratios (each hpkv run against the raw run next to
it); the reads alternate which goes first, and their ratio is the mean of the two orders'
medians (:func:`hpkv.bench.order_balanced`).

Then read throughput of the 1 MiB files with 1, 2 and 4 IO workers (a fresh server
each, same storage directory: it finds the files by itself), and CRC32C's own speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

from hpkv.bench import order_balanced
from hpkv.bench.floors import drop_caches, read_files

SIZES = [128 << 10, 1 << 20, 4 << 20]
HEADLINE = 1 << 20
MAX_FILES = 1024  # per case: keeps the small-file case (per-file costs dominate) under ~20 s
SPILL_WAIT_S = 300.0  # a case's write-through that takes longer is reported, not waited for


def _default_dir() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isdir(os.path.join(repo, ".git")):
        return os.path.join(repo, ".cache", "hpkv-bench-io")
    return "/var/tmp/hpkv-bench-io"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        default=_default_dir(),
        help="storage directory on a real disk (not tmpfs); removed afterwards (default %(default)s)",
    )
    p.add_argument(
        "--mib",
        type=int,
        default=256,
        help=f"MiB written and read per measurement (at most {MAX_FILES} files)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=6,
        help="timed repetitions per case (medians are reported; even: both read orders alike)",
    )
    p.add_argument("--workers", default="1,2,4", help="IO worker counts for the read scaling run")
    p.add_argument(
        "--io-workers",
        type=int,
        help="IO workers of the server the size cases run on (HPKV_NUM_IO_WORKERS, which the bench's "
        "private server does not take from the environment; default: hpkv's default)",
    )
    p.add_argument("--keep", action="store_true", help="keep the files")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class _Bench:
    def __init__(self, args: argparse.Namespace, root: str):
        self.args = args
        self.root = root
        self.storage = os.path.join(root, "hpkv")
        self.raw_root = os.path.join(root, "raw")
        self.o_direct = True
        self.io_workers = 0

    # ------------------------------------------------------------ servers
    def server(self, workers: int | None = None):
        from hpkv.testing.server import ServerProcess, private_env

        extra = {"HPKV_LOG_LEVEL": "INFO"}
        if workers is not None:
            extra["HPKV_NUM_IO_WORKERS"] = str(workers)
        pool = self.args.mib + 64
        srv = ServerProcess(private_env(pool_size=f"{pool}m", storage=self.storage, **extra))
        try:
            return srv.start()
        except BaseException:
            srv.cleanup()  # a server that failed to start leaves its pool directory otherwise
            raise

    # ------------------------------------------------------------ hpkv path
    def hpkv_write(self, client, seg, ns, keys, size, pool, stamp) -> float:
        import numpy as np

        from hpkv.protocol.stats import G
        from hpkv.protocol.wire import slot_offset

        slots = slot_offset(client.reserve(ns.ns_id, keys)[:, 0])  # written here, not by a worker
        if (slots < 0).any():
            raise RuntimeError("the bench pool is too small")
        for i, off in enumerate(slots):
            pool.array[off : off + size] = stamp
            pool.array[off : off + 8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
        target = int(seg.glob[G.STORAGE_SPILLS]) + len(keys)
        errors = int(seg.glob[G.STORAGE_IO_ERRORS])
        t0 = time.perf_counter()
        client.commit(ns.ns_id, keys)
        while int(seg.glob[G.STORAGE_SPILLS]) < target:
            if int(seg.glob[G.STORAGE_IO_ERRORS]) != errors:
                raise RuntimeError(f"spills failed: {client.stats()['storage']}")
            if seg.glob[G.STORAGE_SPILL_PAUSED]:
                st = client.stats()["storage"]
                raise RuntimeError(
                    f"hpkv paused spilling: {st['free_bytes'] >> 20} MiB free of "
                    f"{st['capacity_bytes'] >> 20} MiB in {self.storage} (HPKV_STORAGE_MIN_FREE); "
                    "give --dir more room or lower --mib / --repeat"
                )
            if time.perf_counter() - t0 > SPILL_WAIT_S:
                raise RuntimeError(
                    f"{target - int(seg.glob[G.STORAGE_SPILLS])} of {len(keys)} spills not written "
                    f"after {SPILL_WAIT_S:g} s: {client.stats()['storage']}"
                )
            time.sleep(0.002)
        return time.perf_counter() - t0

    def hpkv_read(self, client, ns, keys, size, pool, stamp) -> float:
        client.clear(ns.ns_id)
        if not self.o_direct:
            drop_caches()
        t0 = time.perf_counter()
        rows = client.promote(ns.ns_id, keys)[:, 0]
        dt = time.perf_counter() - t0
        if (rows < 0).any():
            raise RuntimeError(f"{int((rows < 0).sum())} promotes failed: {client.stats()['storage']}")
        for i, off in enumerate(rows):  # every block's stamp; one block byte by byte
            if int.from_bytes(pool.array[off : off + 8].tobytes(), "little") != i:
                raise RuntimeError(f"block {i} came back wrong")
        if pool.array[rows[-1] + 8 : rows[-1] + size].tobytes() != stamp[8:].tobytes():
            raise RuntimeError("payload came back wrong")
        client.unpin(ns.ns_id, keys)
        return dt

    # ------------------------------------------------------------ raw loop (reference)
    def raw_write(self, fp, keys, buf) -> float:
        from hpkv.io_workers import kvfile

        paths = [kvfile.file_path(self.raw_root, fp, k, 0) for k in keys]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_DIRECT if self.o_direct else 0)
        t0 = time.perf_counter()
        for p in paths:
            try:
                fd = os.open(p, flags, 0o644)
            except FileNotFoundError:  # like the IO worker: directories on first use
                os.makedirs(os.path.dirname(p), exist_ok=True)
                fd = os.open(p, flags, 0o644)
            os.pwritev(fd, [buf], 0)
            os.close(fd)
        dt = time.perf_counter() - t0
        for p in paths:
            os.unlink(p)
        return dt

    def raw_read(self, fp, keys, buf) -> float:
        from hpkv.io_workers import kvfile

        return read_files([kvfile.file_path(self.storage, fp, k, 0) for k in keys], self.o_direct)

    # ------------------------------------------------------------ runs
    def run_sizes(self) -> tuple[list[dict], dict]:
        import mmap

        import numpy as np

        from hpkv.client import connect
        from hpkv.common.pool import PoolFile
        from hpkv.io_workers import kvfile
        from hpkv.protocol import wire as P
        from hpkv.protocol.keys import block_keys, namespace_fingerprint
        from hpkv.protocol.stats import StatsSegment

        a = self.args
        results = []
        headline_keys: dict = {}
        srv = self.server(workers=self.args.io_workers)
        try:
            client = connect(srv.cfg, spawn=False, call_timeout=60.0)
            stats = client.stats()
            self.io_workers = sum(1 for w in stats["workers"] if w["kind"] == "io")
            st = stats["storage"]
            self.o_direct = st["o_direct"]
            self.fs_note = st["o_direct_reason"]
            seg = StatsSegment.attach(srv.pool_dir)
            self.read_bounce = bool(seg.read_catalog().get("storage", {}).get("read_bounce"))
            pool = PoolFile.attach(os.path.join(srv.pool_dir, P.POOL_FILE))
            rng = np.random.default_rng(0)
            for size in SIZES:
                n = files_per_case(a.mib, size)
                fp = namespace_fingerprint({"bench": "io", "size": size})
                ns = client.attach_namespace(fp, 1, size, name=f"bench-io-{size >> 10}k")
                stamp = rng.integers(0, 256, size, dtype=np.uint8)
                fbytes = kvfile.file_size(size)
                raw_mm = mmap.mmap(-1, fbytes)
                raw_buf = memoryview(raw_mm)
                raw_buf[kvfile.HEADER_BYTES : kvfile.HEADER_BYTES + size] = stamp.tobytes()
                t: dict[str, list[float]] = {"write": [], "read": [], "raw_write": [], "raw_read": []}
                for rep in range(a.repeat + 1):  # repetition 0 warms up (directories, caches)
                    keys = block_keys(fp, [f"{rep}-{i}".encode() for i in range(n)])
                    raw_keys = block_keys(fp, [f"raw-{rep}-{i}".encode() for i in range(n)])
                    tw = self.hpkv_write(client, seg, ns, keys, size, pool, stamp)
                    trw = self.raw_write(fp, raw_keys, raw_buf)
                    # Both read the same files; whoever reads second may find them in the VM
                    # host's cache, so the order alternates.
                    if rep % 2:
                        tr = self.hpkv_read(client, ns, keys, size, pool, stamp)
                        trr = self.raw_read(fp, keys, raw_buf)
                    else:
                        trr = self.raw_read(fp, keys, raw_buf)
                        tr = self.hpkv_read(client, ns, keys, size, pool, stamp)
                    client.clear(ns.ns_id)
                    if rep:
                        for name, v in (("write", tw), ("raw_write", trw), ("read", tr), ("raw_read", trr)):
                            t[name].append(v)
                    if size == HEADLINE and rep == a.repeat:
                        headline_keys = {"fp": fp, "keys": keys}
                nbytes = n * fbytes
                r = {"payload_kib": size >> 10, "files": n, "mib": nbytes / 2**20}
                for name, times in t.items():
                    r[f"{name}_gbps"] = _gbps(nbytes, statistics.median(times))
                # Ratios pair each repetition with the raw loop run right next to it, so load
                # that comes and goes on a shared machine cancels out. The reads alternate
                # which goes first: the second often finds the disk faster.
                r["write_vs_raw"] = statistics.median(
                    rw / w for w, rw in zip(t["write"], t["raw_write"], strict=False)
                )
                r["read_vs_raw"] = order_balanced(
                    [rr / x for x, rr in zip(t["read"], t["raw_read"], strict=True)]
                )
                results.append(r)
                raw_buf.release()
                raw_mm.close()
            self.storage_stats = client.stats()["storage"]
            client.close()
            seg.close()
            pool.close()
        finally:
            srv.cleanup()
        return results, headline_keys

    def run_workers(self, counts: list[int], headline: dict) -> dict[str, float]:
        from hpkv.client import connect
        from hpkv.common.pool import PoolFile
        from hpkv.io_workers import kvfile
        from hpkv.protocol import wire as P

        fp, keys = headline["fp"], headline["keys"]
        nbytes = len(keys) * kvfile.file_size(HEADLINE)
        out = {}
        for w in counts:
            srv = self.server(workers=w)
            try:
                client = connect(srv.cfg, spawn=False, call_timeout=60.0)
                ns = client.attach_namespace(fp, 1, HEADLINE)
                pool = PoolFile.attach(os.path.join(srv.pool_dir, P.POOL_FILE))
                hit, _ = client.settled_lookup(ns.ns_id, keys, 10.0)  # the stats or the scan find them
                if hit != len(keys):
                    raise RuntimeError(f"a fresh server found {hit} of {len(keys)} blocks")
                times = []
                for rep in range(self.args.repeat + 1):
                    if not self.o_direct:
                        drop_caches()
                    t0 = time.perf_counter()
                    rows = client.promote(ns.ns_id, keys)
                    dt = time.perf_counter() - t0
                    if (rows < 0).any():
                        raise RuntimeError("promotes failed")
                    client.unpin(ns.ns_id, keys)
                    client.clear(ns.ns_id)
                    if rep:
                        times.append(dt)
                out[str(w)] = _gbps(nbytes, statistics.median(times))
                client.close()
                pool.close()
            finally:
                srv.cleanup()
        return out


def files_per_case(mib: int, payload: int) -> int:
    return max(1, min(MAX_FILES, (mib << 20) // payload))


def _checksum_gbps(repeat: int) -> float:
    import numpy as np

    from hpkv.io_workers.checksum import crc32c

    buf = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    crc32c(buf)
    times = []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        crc32c(buf)
        times.append(time.perf_counter() - t0)
    return _gbps(buf.nbytes, statistics.median(times))


def run(args: argparse.Namespace) -> int:
    from hpkv.common.checks import filesystem_type

    root = os.path.join(os.path.abspath(args.dir), f"run-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    fs = filesystem_type(root)
    if fs in ("tmpfs", "ramfs"):
        print(f"hpkv bench io: {root} is on {fs}; put --dir on a real disk", flush=True)
        os.rmdir(root)
        return 2
    # hpkv's files of every repetition of every size stay until the end: check the room first.
    from hpkv.io_workers import kvfile

    need = sum((args.repeat + 1) * files_per_case(args.mib, size) * kvfile.file_size(size) for size in SIZES)
    need = need * 21 // 20  # and the raw loop's files, one case at a time
    free = shutil.disk_usage(root).free
    if free < need:
        print(
            f"hpkv bench io: {root} has {free >> 20} MiB free; the run writes about {need >> 20} MiB "
            "(lower --mib or --repeat, or use a --dir with more room)",
            flush=True,
        )
        shutil.rmtree(root, ignore_errors=True)
        return 2
    bench = _Bench(args, root)
    t_start = time.monotonic()
    try:
        cases, headline = bench.run_sizes()
        by_workers = bench.run_workers([int(x) for x in args.workers.split(",") if x.strip()], headline)
        checksum = _checksum_gbps(args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    head = next(r for r in cases if r["payload_kib"] == HEADLINE >> 10)
    rnd = lambda v: round(v, 3) if isinstance(v, float) else v  # noqa: E731
    out = {
        "write_gbps": rnd(head["write_gbps"]),
        "read_gbps": rnd(head["read_gbps"]),
        "raw_write_gbps": rnd(head["raw_write_gbps"]),
        "raw_read_gbps": rnd(head["raw_read_gbps"]),
        "write_vs_raw": rnd(head["write_vs_raw"]),
        "read_vs_raw": rnd(head["read_vs_raw"]),
        "read_gbps_by_workers": {k: rnd(v) for k, v in by_workers.items()},
        "checksum_gbps": rnd(checksum),
        "o_direct": bench.o_direct,
        "o_direct_reason": bench.fs_note,
        "read_bounce": bench.read_bounce,
        "io_workers": bench.io_workers,
        "fs_type": fs,
        "dir": root,
        "mib_per_case": args.mib,
        "repeat": args.repeat,
        "seconds": round(time.monotonic() - t_start, 1),
        "cases": [{k: rnd(v) for k, v in r.items()} for r in cases],
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"hpkv bench io: {args.mib} MiB per case on {fs} ({'O_DIRECT' if bench.o_direct else 'buffered'}"
        f"{', reads via a private buffer' if bench.read_bounce else ''}, {bench.io_workers} IO workers), "
        f"median of {args.repeat}; raw = one thread, open+pwritev/preadv+close, same files and sizes"
    )
    print(
        f"{'payload':>8} {'files':>6} {'write GB/s':>10} {'raw':>6} {'ratio':>6} "
        f"{'read GB/s':>10} {'raw':>6} {'ratio':>6}"
    )
    for r in cases:
        print(
            f"{r['payload_kib']:>6}Ki {r['files']:>6} {r['write_gbps']:>10.2f} {r['raw_write_gbps']:>6.2f} "
            f"{r['write_vs_raw']:>6.2f} {r['read_gbps']:>10.2f} {r['raw_read_gbps']:>6.2f} {r['read_vs_raw']:>6.2f}"
        )
    print("read GB/s by IO workers (1 MiB): " + ", ".join(f"{k}: {v:.2f}" for k, v in by_workers.items()))
    print(f"CRC32C: {checksum:.1f} GB/s")
    print(
        "targets: read >= 0.95 x raw at 1 and 4 MiB in the median of 3 runs; write >= 0.85 x raw at "
        f"1 MiB; checksum >= 5 GB/s   ({out['seconds']} s)"
    )
    return 0
