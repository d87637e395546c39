"""Mooncake Store's raw floors: what the remote tier can at best get out of the store.

    hpkv bench remote [--mib 256] [--repeat 3] [--batch 16] [--json]

Two private network namespaces joined by a veth pair (Mooncake binds wildcard addresses, so it
runs nowhere else): the first holds ``mooncake_master`` and a *holder*, a client that only
contributes the memory segment the objects live in; the second runs the measuring client, a
pure client (no segment), so every byte crosses TCP between the two, as a node reading another
node's KV would. For each object size (1, 2, 4, 8 MiB), ``--mib`` per round:

* ``batch_put_from`` / ``batch_get_into`` of the round in calls of ``--batch`` objects, from and
  into one registered ``MAP_SHARED`` buffer (as the pool is): GB/s, median of ``--repeat``
  rounds (each round's keys are new; the round's objects are removed after it). The first
  round's bytes are checked by CRC;
* p50/p99 of single-object calls (one object a call, ``--samples`` of each): the per-block latency;
* CPU seconds per GB moved: the measuring client's own and the holder's (its process is in the
  same pid namespace), over the batched phases.

Then ``batch_is_exist`` of 64 present and 64 missing keys (p50/p99 over ``--samples`` calls).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from hpkv.bench.floors import machine_busy_s

SIZES_MIB = (1, 2, 4, 8)
EXISTS_KEYS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=256, help="MiB moved per round and object size (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per object size; GB/s is their median")
    p.add_argument("--batch", type=int, default=16, help="objects per batch call (default 16)")
    p.add_argument("--samples", type=int, default=100, help="single-object calls and exists calls timed")
    p.add_argument(
        "--blocks",
        type=int,
        default=64,
        help="the hpkv phase: blocks node A publishes and node B promotes (0: no hpkv phase)",
    )
    p.add_argument(
        "--block-mib",
        type=int,
        default=7,
        help="MiB per block in the hpkv phase (7: 128 tokens of Qwen2.5-7B)",
    )
    p.add_argument(
        "--part-mib",
        type=int,
        default=16,
        help="the hpkv phase's loads in parts: HPKV_PROMOTE_PART_SIZE in MiB (default 16, its default)",
    )
    p.add_argument(
        "--spinners",
        type=int,
        default=0,
        help="the hpkv phase: processes spinning on sched_yield on node B meanwhile, as vLLM's "
        "EngineCore and worker do while a request waits for its load (default 0)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="after the hpkv phase: raw gets of its objects by 1/2/4 threads x 8/16/32/all objects a "
        "call (plain and as the remote worker reads them) and hpkv's CRC32C rate, from node B",
    )


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (the holder, from the measuring client)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Client:
    """The measuring side: runs inside the second namespace (``--role client``)."""

    def __init__(self, args: argparse.Namespace):
        from hpkv.testing import mooncake as mc

        self.args = args
        self.store = mc.connect(args.local, args.metadata, args.master, segment=0)
        self.span = args.mib << 20
        self.buf = mmap.mmap(-1, 2 * self.span, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.buf[: self.span] = os.urandom(1 << 20) * (self.span >> 20)
        self.buf[self.span :] = bytes(self.span)  # touched before any timing
        rc = self.store.register_buffer(self.base, 2 * self.span)
        if rc != 0:
            raise RuntimeError(f"register_buffer failed: {rc}")
        self.seq = 0

    def _keys(self, n: int) -> list[str]:
        self.seq += 1
        return [f"bench/{self.seq}/{i}" for i in range(n)]

    def _batched(self, call: Any, keys: list[str], base: int, size: int) -> float:
        b = self.args.batch
        t0 = time.perf_counter()
        for i in range(0, len(keys), b):
            part = keys[i : i + b]
            rcs = call(part, [base + (i + j) * size for j in range(len(part))], [size] * len(part))
            bad = [rc for rc in rcs if rc < 0]
            if bad:
                raise RuntimeError(f"{call.__name__} failed: {bad[:4]} (of {len(bad)})")
        return time.perf_counter() - t0

    def _cpu(self) -> tuple[float, float]:
        return time.process_time(), _cpu_s(self.args.holder_pid)

    def size_case(self, mib: int) -> dict[str, Any]:
        size = mib << 20
        n = max(1, self.span // size)
        nbytes = n * size
        put_t, get_t = [], []
        cpu = {"put_client": 0.0, "put_holder": 0.0, "get_client": 0.0, "get_holder": 0.0}
        for r in range(self.args.repeat):
            keys = self._keys(n)
            c0, h0 = self._cpu()
            put_t.append(self._batched(self.store.batch_put_from, keys, self.base, size))
            c1, h1 = self._cpu()
            get_t.append(self._batched(self.store.batch_get_into, keys, self.base + self.span, size))
            c2, h2 = self._cpu()
            cpu["put_client"] += c1 - c0
            cpu["put_holder"] += h1 - h0
            cpu["get_client"] += c2 - c1
            cpu["get_holder"] += h2 - h1
            if r == 0 and zlib.crc32(self.buf[self.span : self.span + nbytes]) != zlib.crc32(
                self.buf[:nbytes]
            ):
                raise RuntimeError(f"{mib} MiB objects: the bytes read back differ from those put")
            self.store.batch_remove(keys, True)
        lat_put, lat_get = [], []
        keys = self._keys(self.args.samples)
        for i, k in enumerate(keys):
            off = (i % n) * size
            t0 = time.perf_counter()
            rc = self.store.batch_put_from([k], [self.base + off], [size])
            lat_put.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rc += self.store.batch_get_into([k], [self.base + self.span + off], [size])
            lat_get.append(time.perf_counter() - t0)
            if rc[0] != 0 or rc[1] != size:
                raise RuntimeError(f"single-object put/get of {mib} MiB failed: {rc}")
            self.store.batch_remove([k], True)
        gb = nbytes * self.args.repeat / 1e9
        return {
            "object_mib": mib,
            "objects": n,
            "put_gbps": round(nbytes / statistics.median(put_t) / 1e9, 3),
            "get_gbps": round(nbytes / statistics.median(get_t) / 1e9, 3),
            "put_p50_ms": round(_pct(lat_put, 0.5) * 1e3, 3),
            "put_p99_ms": round(_pct(lat_put, 0.99) * 1e3, 3),
            "get_p50_ms": round(_pct(lat_get, 0.5) * 1e3, 3),
            "get_p99_ms": round(_pct(lat_get, 0.99) * 1e3, 3),
            "cpu_s_per_gb": {k: round(v / gb, 3) for k, v in cpu.items()},
        }

    def exists_case(self) -> dict[str, Any]:
        size = 4096
        present = self._keys(EXISTS_KEYS)
        rcs = self.store.batch_put_from(
            present, [self.base + i * size for i in range(EXISTS_KEYS)], [size] * EXISTS_KEYS
        )
        assert all(rc == 0 for rc in rcs), rcs
        missing = self._keys(EXISTS_KEYS)
        out: dict[str, Any] = {}
        for name, keys, want in (("present", present, 1), ("missing", missing, 0)):
            ts = []
            for _ in range(self.args.samples):
                t0 = time.perf_counter()
                got = self.store.batch_is_exist(keys)
                ts.append(time.perf_counter() - t0)
                if any(g != want for g in got):
                    raise RuntimeError(f"batch_is_exist of {name} keys answered {sorted(set(got))}")
            out[f"exists_{EXISTS_KEYS}_{name}_us"] = {
                "p50": round(_pct(ts, 0.5) * 1e6, 1),
                "p99": round(_pct(ts, 0.99) * 1e6, 1),
            }
        self.store.batch_remove(present, True)
        return out

    def run(self) -> dict[str, Any]:
        sizes = sorted({*SIZES_MIB, *([self.args.block_mib] if self.args.blocks else [])})
        out: dict[str, Any] = {"sizes": [self.size_case(m) for m in sizes]}
        out.update(self.exists_case())
        self.store.unregister_buffer(self.base)
        self.store.close()
        return out


def _holder(args: argparse.Namespace) -> int:
    """Contributes the segment (``--role holder``): ready on stdout, then holds until stdin closes."""
    from hpkv.testing import mooncake as mc

    store = mc.connect(args.local, args.metadata, args.master, segment=args.segment)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()
    return 0


class _RawGets:
    """``--role floor``: ``--count`` objects of ``--object-bytes`` put by a pure client (so
    they live in segments held elsewhere), then read back whole with ``batch_get_into`` in
    batches of ``--batch`` into one registered buffer, a round at a time (:meth:`round`; the
    first round's bytes are checked). The objects are removed at :meth:`close`."""

    def __init__(self, args: argparse.Namespace):
        from hpkv.testing import mooncake as mc

        self.store = mc.connect(args.local, args.metadata, args.master, segment=0)
        self.size, self.n, self.batch = args.object_bytes, args.count, args.batch
        self.span = self.size * self.n
        self.buf = mmap.mmap(-1, 2 * self.span, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.buf[: self.span] = os.urandom(self.size) * self.n
        self.buf[self.span :] = bytes(self.span)  # touched before any timing
        if self.store.register_buffer(self.base, 2 * self.span) != 0:
            raise RuntimeError("register_buffer failed")
        self.keys = [f"floor/{os.getpid()}/{i}" for i in range(self.n)]
        self.rounds = 0
        self.busy_s = 0.0
        self._call(self.store.batch_put_from, self.base, 0)

    def _call(self, call: Any, base: int, want: int) -> None:
        for i in range(0, self.n, self.batch):
            part = self.keys[i : i + self.batch]
            rcs = call(part, [base + j * self.size for j in range(i, i + len(part))], [self.size] * len(part))
            if any(rc != want for rc in rcs):
                raise RuntimeError(f"{call.__name__} failed: {rcs}")

    def round(self) -> float:
        """Seconds to read every object once (and in :attr:`busy_s` the machine's CPU seconds
        meanwhile, the first round's check of the bytes left out)."""
        b0, t0 = machine_busy_s(), time.perf_counter()
        self._call(self.store.batch_get_into, self.base + self.span, self.size)
        took = time.perf_counter() - t0
        self.busy_s = machine_busy_s() - b0
        if self.rounds == 0 and zlib.crc32(self.buf[self.span :]) != zlib.crc32(self.buf[: self.span]):
            raise RuntimeError("the bytes read back differ from those put")
        self.rounds += 1
        return took

    def threaded_round(self, threads: int, batch: int, multi: bool) -> float:
        """Seconds to read every object once in calls of ``batch`` objects taken in turn by
        ``threads`` threads (as the remote worker's getters take promotes); ``multi``: each
        object read as the remote worker reads it, with ``batch_get_into_multi_buffers`` into
        a 4096-byte header page and the rest (here adjacent)."""
        parts = [list(range(i, min(i + batch, self.n))) for i in range(0, self.n, batch)]
        todo = iter(parts)
        lock = threading.Lock()
        errors: list[str] = []
        dst = self.base + self.span

        def work() -> None:
            while True:
                with lock:
                    part = next(todo, None)
                if part is None:
                    return
                names = [self.keys[i] for i in part]
                if multi:
                    head = 4096
                    ptrs = [[dst + i * self.size, dst + i * self.size + head] for i in part]
                    sizes = [[head, self.size - head] for _ in part]
                    rcs = self.store.batch_get_into_multi_buffers(names, ptrs, sizes)
                else:
                    rcs = self.store.batch_get_into(
                        names, [dst + i * self.size for i in part], [self.size] * len(part)
                    )
                if any(rc != self.size for rc in rcs):
                    errors.append(f"threads {threads} batch {batch}: {rcs[:4]}")

        t0 = time.perf_counter()
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        took = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"threaded batch_get_into failed: {errors[0]}")
        return took

    def crc_gbps(self, repeat: int = 3) -> float:
        """hpkv's CRC32C (the check every promoted object gets) over the round's bytes, GB/s."""
        from hpkv.io_workers.checksum import crc32c

        view = memoryview(self.buf)[self.span :]
        best = min(self._timed(lambda: crc32c(view)) for _ in range(repeat))
        view.release()
        return self.span / best / 1e9

    @staticmethod
    def _timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.store.batch_remove(self.keys, True)
        self.store.unregister_buffer(self.base)
        self.store.close()


def _floor(args: argparse.Namespace) -> None:
    """``--role floor``: ``--repeat`` rounds, then their rates as JSON (the best and each);
    with ``--stdin``, ``ready``, then one round per line read, its seconds printed."""
    raw = _RawGets(args)
    try:
        if args.stdin:
            print("ready", flush=True)
            for _ in sys.stdin:
                print(raw.round(), flush=True)
            return
        if args.sweep:
            print(json.dumps(_sweep(raw, args.repeat)), flush=True)
            return
        rates, busy = [], []  # busy: the machine's CPU seconds over each round (both nodes, the kernel)
        for _ in range(args.repeat):
            rates.append(raw.span / raw.round() / 1e9)
            busy.append(raw.busy_s)
        print(
            json.dumps(
                {
                    "best": round(max(rates), 3),
                    "rounds": [round(r, 3) for r in rates],
                    "bytes": raw.span,
                    "machine_cpu_s": [round(b, 3) for b in busy],
                }
            ),
            flush=True,
        )
    finally:
        raw.close()


SWEEP_THREADS = (1, 2, 4)
SWEEP_BATCHES = (8, 16, 32, 0)  # 0: every object in one call


def _sweep(raw: _RawGets, repeat: int) -> dict[str, Any]:
    """Raw gets of ``raw``'s objects by 1/2/4 threads x 8/16/32/all objects a call, plain and
    in the remote worker's two-buffer form, each the best of ``repeat`` rounds; the reference
    (one thread, one plain call of every object) is measured between each case and the next,
    so each case has a ratio to a reference of the same moment (``vs_one_call``)."""
    raw.round()  # the first round checks the bytes
    cases = []
    for multi in (False, True):
        for threads in SWEEP_THREADS:
            for b in sorted({min(batch or raw.n, raw.n) for batch in SWEEP_BATCHES}):
                if threads > 1 and -(-raw.n // b) < threads:
                    continue  # fewer calls than threads
                ts, refs = [], []
                for _ in range(repeat):
                    refs.append(raw.threaded_round(1, raw.n, False))
                    ts.append(raw.threaded_round(threads, b, multi))
                cases.append(
                    {
                        "threads": threads,
                        "batch": b,
                        "multi_buffers": multi,
                        "gbps": round(raw.span / min(ts) / 1e9, 3),
                        "vs_one_call": round(
                            statistics.median(t / r for t, r in zip(ts, refs, strict=True)), 3
                        ),
                    }
                )
    return {
        "objects": raw.n,
        "object_bytes": raw.size,
        "repeat": repeat,
        "cases": cases,
        "crc32c_gbps": round(raw.crc_gbps(), 2),
    }


def raw_sweep(ns: Any, m: Any, object_bytes: int, count: int, repeat: int = 3) -> dict[str, Any]:
    """:func:`_sweep` run by a pure client inside ``ns``."""
    cmd, env = _floor_cmd(ns, m, object_bytes, count, "--repeat", str(repeat), "--sweep")
    r = ns.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"the raw batch_get_into sweep failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _floor_cmd(
    ns: Any, m: Any, object_bytes: int, count: int, *extra: str
) -> tuple[list[str], dict[str, str]]:
    """The ``--role floor`` command line and environment for a client in ``ns``."""
    from hpkv.testing import mooncake as mc

    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "hpkv.bench.remote", "--role", "floor", "--local", ns.addr]
    cmd += ["--metadata", m.metadata, "--master", m.rpc, "--object-bytes", str(object_bytes)]
    cmd += ["--count", str(count), *extra]
    return cmd, mc.client_env(ns.addr, env)


#: A process that does what vLLM's EngineCore and its worker do while waiting for each other
#: (shm MessageQueue readers spin on ``sched_yield`` for up to 1 s after their last read).
SPINNER = "import os\nwhile True:\n    os.sched_yield()\n"


def raw_get_gbps(
    ns: Any, m: Any, object_bytes: int, count: int, repeat: int = 3, batch: int = 16, spinners: int = 0
) -> dict[str, Any]:
    """The raw ``batch_get_into`` rate of ``count`` objects of ``object_bytes``, read by a pure
    client inside ``ns`` (a namespace of :mod:`hpkv.testing.netns`, in the master ``m``'s
    cluster): ``{"best": GB/s, "rounds": [...]}`` over ``repeat`` rounds. ``spinners``:
    processes spinning on ``sched_yield`` meanwhile (:data:`SPINNER`: an engine waiting for a
    load), stopped before it returns."""
    cmd, env = _floor_cmd(ns, m, object_bytes, count, "--repeat", str(repeat), "--batch", str(batch))
    with _stopped(ns, [ns.popen([sys.executable, "-c", SPINNER]) for _ in range(spinners)]):
        r = ns.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"the raw batch_get_into floor failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _role_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hpkv.bench.remote")
    add_arguments(p)
    p.add_argument("--role", choices=("holder", "client", "floor"), required=True)
    p.add_argument("--object-bytes", type=int, default=7 << 20)
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--stdin", action="store_true", help="floor: one round per line read")
    p.add_argument("--local", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--segment", type=int, default=0)
    p.add_argument("--holder-pid", type=int, default=0)
    args = p.parse_args(argv)
    if args.role == "holder":
        return _holder(args)
    if args.role == "floor":
        _floor(args)
        return 0
    print(json.dumps(_Client(args).run()), flush=True)
    return 0


def _print(out: dict[str, Any]) -> None:
    print(
        f"hpkv bench remote: Mooncake Store {out['mooncake']}, TCP over a veth pair between two network "
        f"namespaces; {out['mib']} MiB a round, batches of {out['batch']}, median of {out['repeat']} rounds; "
        f"latency: {out['samples']} single-object calls"
    )
    print(
        f"{'object':>7} {'put GB/s':>9} {'get GB/s':>9} {'put p50/p99 ms':>15} {'get p50/p99 ms':>15} "
        f"{'CPU-s/GB put c+h':>17} {'get c+h':>12}"
    )
    for r in out["sizes"]:
        c = r["cpu_s_per_gb"]
        print(
            f"{r['object_mib']:>5}Mi {r['put_gbps']:>9.2f} {r['get_gbps']:>9.2f} "
            f"{r['put_p50_ms']:>7.2f}/{r['put_p99_ms']:<7.2f} {r['get_p50_ms']:>7.2f}/{r['get_p99_ms']:<7.2f} "
            f"{c['put_client']:>8.2f}+{c['put_holder']:<8.2f} {c['get_client']:>5.2f}+{c['get_holder']:<6.2f}"
        )
    for k in (f"exists_{EXISTS_KEYS}_present_us", f"exists_{EXISTS_KEYS}_missing_us"):
        print(f"{k}: p50 {out[k]['p50']} us, p99 {out[k]['p99']} us")
    h = out.get("hpkv")
    if h:
        print(
            f"hpkv remote hit: node B promotes {h['blocks']} x {h['block_mib']} MiB blocks node A published: "
            f"{h['promote_gbps']:.2f} GB/s (median of {len(h['promote_s'])}) vs raw batch_get_into of as "
            f"many objects of the same size {h['raw_get_gbps']:.2f} GB/s, a round right before or after each "
            f"promote: {h['vs_raw']:.2f}x the raw time (median of the pairs; target <= 1.3); publish "
            f"{h['publish_gbps']:.2f} GB/s; first lookup {h['discover_ms']} ms"
        )
    for ld in (h or {}).get("load", {}).values():
        how = (
            f"in parts of >= {ld['part_mib']} MiB, {ld['connections']} read at once, each copied out "
            "of the pool while the next ones are read"
            if ld["part_mib"]
            else "in one part, then copied out of the pool"
        )
        print(
            f"hpkv remote hit loaded as vLLM's connector loads it ({how}): "
            f"{statistics.median(ld['load_s']):.3f} s, {ld['vs_raw']:.2f}x the raw time (median of the pairs)"
        )
    if h and h.get("sweep"):
        _print_sweep(h["sweep"], h)
    print(f"({out['seconds']} s)")


def _print_sweep(sw: dict[str, Any], h: dict[str, Any]) -> None:
    """The raw gets by threads x objects a call next to the one-call floor, and what the
    checks of a promote's bytes cost at hpkv's CRC32C rate."""
    n, size = sw["objects"], sw["object_bytes"]
    print(
        f"raw gets of the {n} objects of {size} bytes from node B, best of {sw['repeat']} rounds; "
        "vs_one_call: the median ratio to one thread reading all in one plain call, measured "
        "right before each round"
    )
    print(f"{'threads':>8} {'objects/call':>13} {'form':>12} {'GB/s':>7} {'vs_one_call':>12}")
    for c in sw["cases"]:
        form = "hdr+slot" if c["multi_buffers"] else "plain"
        print(f"{c['threads']:>8} {c['batch']:>13} {form:>12} {c['gbps']:>7.2f} {c['vs_one_call']:>11.2f}x")
    verify_ms = n * size / (sw["crc32c_gbps"] * 1e9) * 1e3
    floor_ms = n * size / (h["raw_get_gbps"] * 1e9) * 1e3
    print(
        f"CRC32C (hpkv's check of every promoted byte) {sw['crc32c_gbps']:.2f} GB/s: {verify_ms:.1f} ms for "
        f"the {n} objects, {verify_ms / floor_ms:.2f}x of their raw get ({floor_ms:.1f} ms) if none overlapped"
    )


def _measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Master and holder in one namespace, the measuring client in the other; its JSON."""
    from hpkv.testing import mooncake as mc
    from hpkv.testing import netns

    common = ["--mib", str(args.mib), "--repeat", str(args.repeat), "--batch", str(args.batch)]
    common += [
        "--samples",
        str(args.samples),
        "--blocks",
        str(args.blocks),
        "--block-mib",
        str(args.block_mib),
    ]
    me = [sys.executable, "-m", "hpkv.bench.remote"]
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    with netns.namespaces(2, veth=True) as (a, b), mc.master(a, tmp) as m:
        where = ["--metadata", m.metadata, "--master", m.rpc]
        # Room for a round and the single-object phase (removed objects are freed lazily).
        segment = (2 * args.mib << 20) + (args.samples + 64) * (8 << 20)
        with open(tmp / "holder.log", "wb") as log:
            cmd = [*me, "--role", "holder", "--local", a.addr, *where, "--segment", str(segment), *common]
            holder = a.popen(
                cmd, env=mc.client_env(a.addr, env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )
        assert holder.stdout is not None and holder.stdin is not None
        if holder.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the holder did not start: {(tmp / 'holder.log').read_text()[-2000:]}")
        # The holder's pid as the host sees it: ``ip netns exec`` replaced itself with python.
        cmd = [*me, "--role", "client", "--local", b.addr, *where, "--holder-pid", str(holder.pid), *common]
        r = b.run(cmd, env=mc.client_env(b.addr, env), capture_output=True, text=True, timeout=1800)
        with contextlib.suppress(BrokenPipeError):
            holder.stdin.close()
        if r.returncode != 0:
            raise RuntimeError(f"the client failed:\n{r.stderr[-3000:]}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            holder.wait(30)  # its segment freed before the hpkv phase maps two pools
        out = json.loads(r.stdout.strip().splitlines()[-1])
        if args.blocks:
            out["hpkv"] = _hpkv_phase(args, a, b, m)
        return out


def _remote_hit(
    c: Any, ns_id: int, keys: list[bytes], pool: Any, shard: int, crcs: list[int] | None
) -> float:
    """One promote of blocks that are remote hits (checked against ``crcs`` when given); their
    DRAM copies are dropped again after. Returns its seconds."""
    t0 = time.perf_counter()
    rows = c.promote(ns_id, keys)
    took = time.perf_counter() - t0
    if (rows < 0).any():
        raise RuntimeError(f"hpkv phase: {int((rows < 0).sum())} block(s) not loaded")
    if crcs is not None and [zlib.crc32(pool.array[off : off + shard].data) for off in rows[:, 0]] != crcs:
        raise RuntimeError("hpkv phase: node B's blocks differ from node A's")
    c.unpin(ns_id, keys)
    _drop(c, ns_id, keys)
    return took


def _remote_load(
    c: Any, ahead: Any, ns_id: int, keys: list[bytes], pool: Any, shard: int, part_bytes: int, dst: Any
) -> float:
    """A remote hit loaded as vLLM's connector loads it (:func:`load_in_parts`: promoted in
    parts of ``part_bytes``, two at once through ``c`` and ``ahead``, each part copied out of the
    pool into ``dst``, the engine's KV cache here, while the next ones are read). Its seconds;
    the DRAM copies dropped after."""
    import numpy as np

    from hpkv.connectors.promote import load_in_parts

    def copy(idx: Any, offs: Any) -> bool:
        for i, off in zip(idx, offs, strict=True):
            dst[i * shard : (i + 1) * shard] = pool.array[off : off + shard]
        return True

    t0 = time.perf_counter()
    missing = np.full(len(keys), -1, np.int64)
    ok = load_in_parts(c, ns_id, keys, missing, 0, shard, part_bytes, 120.0, copy, ahead=ahead)
    took = time.perf_counter() - t0
    if not ok.all():
        raise RuntimeError(f"hpkv phase: {int((~ok).sum())} block(s) not loaded in parts")
    _drop(c, ns_id, keys)
    return took


def _drop(c: Any, ns_id: int, keys: list[bytes]) -> None:
    """Drop node B's DRAM copies (unpinned) until every block is a remote hit again."""
    from hpkv.protocol.wire import Tier

    n = len(keys)
    c.clear(ns_id)
    deadline = time.monotonic() + 60
    while c.lookup(ns_id, keys) != (n, [Tier.REMOTE] * n):
        if time.monotonic() > deadline:
            raise RuntimeError("hpkv phase: node B's DRAM copies were not dropped")
        time.sleep(0.01)


class _RawClient:
    """A ``--role floor --stdin`` client in namespace ``ns``: :meth:`round` reads its objects
    once with raw ``batch_get_into`` calls and returns the seconds; ended at the block's end."""

    def __init__(self, ns: Any, m: Any, object_bytes: int, count: int, batch: int):
        cmd, env = _floor_cmd(ns, m, object_bytes, count, "--stdin", "--batch", str(batch))
        self.ns = ns
        self.proc = ns.popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> _RawClient:
        if self.proc.stdout.readline().strip() != "ready":
            self.ns.stop(self.proc)
            raise RuntimeError("the raw batch_get_into client did not start")
        return self

    def round(self) -> float:
        self.proc.stdin.write("get\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the raw batch_get_into client failed")
        return float(line)

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # it removes its objects and exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.ns.stop(self.proc)


@contextlib.contextmanager
def _stopped(ns: Any, procs: list[Any]) -> Any:
    """``procs`` (started in ``ns``) are stopped at the block's end."""
    try:
        yield
    finally:
        for p in procs:
            ns.stop(p)


def _paired(repeat: int, hit: Any, raw: Any) -> tuple[list[float], list[float]]:
    """``repeat`` rounds of ``hit(round)`` each paired with a ``raw()`` right after it, or
    right before it on odd rounds (an order effect cannot pass for hpkv's); their seconds."""
    hits, raws = [], []
    for r in range(repeat):
        if r % 2:
            raws.append(raw())
        hits.append(hit(r))
        if not r % 2:
            raws.append(raw())
    return hits, raws


def _hpkv_phase(args: argparse.Namespace, a: Any, b: Any, m: Any) -> dict[str, Any]:
    """Two hpkv servers with the remote tier: node A (in the master's namespace, its remote
    worker holding the segment) saves ``--blocks`` blocks, which it publishes; node B (a pure
    client) finds them with a lookup and promotes them, ``--repeat`` times (its DRAM copies
    dropped in between). The bytes are checked on the first round.

    Each promote is paired with a round of raw ``batch_get_into`` of as many objects of the
    same size (the block's image), read from node B's namespace by a pure client as well
    (:class:`_RawGets`, objects in node A's segment), right before or after it (the order
    alternates): ``vs_raw`` is the median of the pairs' ratios, so a shared machine whose
    speed drifts between seconds moves both halves of a pair alike."""
    import numpy as np

    from hpkv.client import connect
    from hpkv.common.pool import PoolFile
    from hpkv.protocol import wire as P
    from hpkv.protocol.keys import block_keys, namespace_fingerprint
    from hpkv.testing import mooncake as mc
    from hpkv.testing.server import ServerProcess, private_env

    shard, n = args.block_mib << 20, args.blocks
    pool = f"{n * (args.block_mib + 1) + 64}m"
    fp = namespace_fingerprint({"bench": "remote", "shard": shard})

    def node(ns: Any, segment: str, **extra: str) -> ServerProcess:
        env = private_env(
            pool_size=pool,
            storage="",
            HPKV_LOG_LEVEL="INFO",
            **mc.node_keys(m, ns.addr, segment),
            **extra,
        )
        return ServerProcess(env, prefix=ns.argv([]))

    def remote(c: Any) -> dict[str, Any]:
        return c.stats()["storage"]["remote"] or {}

    def wait(cond: Any, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(f"hpkv phase: timed out waiting for {what}")
            time.sleep(0.01)

    servers: list[ServerProcess] = []
    try:
        sa = node(a, f"{3 * n * (args.block_mib + 1) + 64}m")  # hpkv's objects, the raw ones, room
        servers.append(sa.start())
        sb = node(b, "0", HPKV_REMOTE_LOOKUP_WAIT_MS="5000")
        servers.append(sb.start())
        ca, cb, cb2 = (connect(s.cfg, spawn=False, call_timeout=120.0) for s in (sa, sb, sb))
        na, nb, nb2 = (c.attach_namespace(fp, 1, shard, name="bench-remote") for c in (ca, cb, cb2))
        assert nb2.ns_id == nb.ns_id, "one namespace, one id on a server"
        pa, pb = (PoolFile.attach(os.path.join(s.pool_dir, P.POOL_FILE)) for s in (sa, sb))
        keys = block_keys(fp, [str(i).encode() for i in range(n)])
        rng = np.random.default_rng(0)
        slots = P.slot_offset(ca.reserve(na.ns_id, keys))[:, 0]
        crcs = []
        for off in slots:
            pa.array[off : off + shard] = rng.integers(0, 256, shard, dtype=np.uint8)
            crcs.append(zlib.crc32(pa.array[off : off + shard].data))
        t0 = time.perf_counter()
        ca.commit(na.ns_id, keys, rank=0)
        wait(lambda: remote(ca).get("published", 0) >= n, f"{n} blocks published")
        publish_s = time.perf_counter() - t0  # (counters reach the stats within 0.2 s)
        t0 = time.perf_counter()
        wait(
            lambda: cb.lookup(nb.ns_id, keys) == (n, [P.Tier.REMOTE] * n),
            "node B's lookup to find every block",
        )
        discover_s = time.perf_counter() - t0
        kv = np.ones(n * shard, np.uint8)  # the engine's KV cache of the loads (touched)
        loads: dict[str, dict[str, Any]] = {}
        spin = [b.popen([sys.executable, "-c", SPINNER]) for _ in range(args.spinners)]
        with _stopped(b, spin), _RawClient(b, m, shard + 4096, n, args.batch) as raw:
            times, raw_s = _paired(
                args.repeat,
                lambda r: _remote_hit(cb, nb.ns_id, keys, pb, shard, crcs if r == 0 else None),
                raw.round,
            )
            # as the connector loads (two connections: two parts read at once), the same through
            # one connection (one part ahead: what the second connection gains), in one part
            variants = (
                ("parts", args.part_mib << 20, cb2),
                ("parts_one_connection", args.part_mib << 20, None),
                ("one_part", 0, cb2),
            )
            for name, part, c2 in variants:
                lt, lr = _paired(
                    args.repeat,
                    lambda r, part=part, c2=c2: _remote_load(cb, c2, nb.ns_id, keys, pb, shard, part, kv),
                    raw.round,
                )
                loads[name] = {
                    "part_mib": part >> 20,
                    "connections": 1 if c2 is None else 2,
                    "load_s": [round(t, 4) for t in lt],
                    "raw_get_s": [round(t, 4) for t in lr],
                    "vs_raw": round(statistics.median(t / r for t, r in zip(lt, lr, strict=True)), 3),
                }
        if [zlib.crc32(kv[i * shard : (i + 1) * shard].data) for i in range(n)] != crcs:
            raise RuntimeError("hpkv phase: the blocks loaded in parts differ from node A's")
        nbytes = n * shard
        sweep = raw_sweep(b, m, shard + 4096, n, args.repeat) if args.sweep else None
        for c in (ca, cb, cb2):
            c.close()
        for p in (pa, pb):
            p.close()
        return {
            "block_mib": args.block_mib,
            "blocks": n,
            "spinners": args.spinners,
            "publish_gbps": round(nbytes / publish_s / 1e9, 3),
            "discover_ms": round(discover_s * 1e3, 1),
            "promote_s": [round(t, 4) for t in times],
            "promote_gbps": round(nbytes / statistics.median(times) / 1e9, 3),
            "raw_get_s": [round(t, 4) for t in raw_s],
            # the raw objects are the blocks' images: the header page and the payload
            "raw_get_gbps": round(n * (shard + 4096) / statistics.median(raw_s) / 1e9, 3),
            # hpkv's time for a remote hit over the same bytes' raw batch_get_into time
            "vs_raw": round(statistics.median(t / r for t, r in zip(times, raw_s, strict=True)), 3),
            # the same blocks loaded as vLLM's connector loads them (in parts, each copied out
            # of the pool while the next is read), and in one part, each paired with raw gets
            "load": loads,
            **({"sweep": sweep} if sweep else {}),
        }
    finally:
        for s in servers:
            s.cleanup()


def run(args: argparse.Namespace) -> int:
    from hpkv.io_workers import mooncake_api
    from hpkv.testing import netns

    why = netns.unavailable() or mooncake_api.unavailable()
    if why:
        print(f"hpkv bench remote: {why}", file=sys.stderr, flush=True)
        return 2
    t_start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="hpkv-bench-remote-") as tmp:
            measured = _measure(args, Path(tmp))
    except RuntimeError as e:
        print(f"hpkv bench remote: {e}", file=sys.stderr, flush=True)
        return 1
    out = {
        "mooncake": mooncake_api.installed_version() or "unknown",
        "transport": "tcp, veth pair between two network namespaces (segment holder <-> pure client)",
        "mib": args.mib,
        "repeat": args.repeat,
        "batch": args.batch,
        "samples": args.samples,
        **measured,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return 0


if __name__ == "__main__":
    sys.exit(_role_main(sys.argv[1:]))
