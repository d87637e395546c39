"""Which blocks deserve a storage write, and which DRAM block goes first? ``HPKV_STORAGE_ADMIT``
policies (``--policies``) and ``HPKV_DRAM_EVICTION`` policies (``--evictions``) side by side on
one many-users workload, through a real hpkv server per pair (no engine: the server's own
lookups, promotes and saves, as the connectors make them).

The workload is the shape of SGLang's multi-turn benchmark: ``--users`` conversations share a
system prompt of ``--system-blocks`` blocks; each turn a user's prompt is the system prompt, its
history and a new message of ``--turn-blocks`` blocks, which then joins its history. Between
the rounds of turns, ``--one-shots`` prompts of ``--one-shot-blocks`` blocks that nobody sends
again (a scan through the pool). The DRAM
pool (``--pool``) is smaller than the working set, so storage hits matter. After the last round
every server restarts (an empty pool) and each user sends one more turn: what storage kept.

Per pair: blocks hit from DRAM and from storage (read back: promoted), blocks recomputed, bytes
written to storage, and the same after the restart. ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from typing import Any

ONE_SHOT_BLOCKS = 32
DRAIN_TIMEOUT_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policies", default="always,reuse:1,reuse:2", help="HPKV_STORAGE_ADMIT values to compare"
    )
    p.add_argument(
        "--evictions", default="lru", help="HPKV_DRAM_EVICTION values to compare (with each admission policy)"
    )
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-blocks", type=int, default=64)
    p.add_argument("--turn-blocks", type=int, default=16)
    p.add_argument("--one-shots", type=int, default=4, help="one-shot prompts after each round")
    p.add_argument(
        "--one-shot-blocks", type=int, default=ONE_SHOT_BLOCKS, help="blocks of one one-shot prompt"
    )
    p.add_argument(
        "--settle",
        action="store_true",
        help="wait for the storage writes after each request (as an engine's prefill time would): "
        "the pool then never refuses a save for blocks still being written, and the runs are "
        "repeatable",
    )
    p.add_argument("--block-kib", type=int, default=64, help="bytes of one block (KiB)")
    p.add_argument("--pool", default="32m", help="DRAM pool size (smaller than the working set)")
    p.add_argument("--dir", default="/var/tmp", help="where the storage directories go (removed after)")


class _Traffic:
    """One policy's server and the clients' view of the workload."""

    def __init__(self, client: Any, ns_id: int, fp: str, settle: bool = False):
        self.c, self.ns, self.fp, self.settle = client, ns_id, fp, settle
        self.counts = {"requests": 0, "blocks": 0, "dram_hits": 0, "storage_hits": 0, "recomputed": 0}

    def request(self, names: list[bytes]) -> None:
        """Look the prompt up, load its hit, save the rest (what a connector does per request)."""
        from hpkv.protocol.keys import block_keys

        keys = block_keys(self.fp, names)
        hit, tiers = self.c.settled_lookup(self.ns, keys, patience_s=2.0)
        if hit:
            rows = self.c.promote(self.ns, keys[:hit])
            loaded = [k for k, row in zip(keys[:hit], rows, strict=True) if (row >= 0).all()]
            self.c.unpin(self.ns, loaded)
            if len(loaded) < hit:  # a block evicted between lookup and load: recomputed from it
                hit, tiers = len(loaded), tiers[: len(loaded)]
        fresh = keys[hit:]
        if fresh:
            slots = self.c.reserve(self.ns, fresh)
            mine = [k for k, row in zip(fresh, slots, strict=True) if (row >= 0).all()]
            if mine:
                self.c.commit(self.ns, mine)
                if self.settle:
                    _drained(self.c, poll_s=0.002)
        n = self.counts
        n["requests"] += 1
        n["blocks"] += len(keys)
        n["dram_hits"] += tiers.count(1)
        n["storage_hits"] += tiers.count(2)
        n["recomputed"] += len(keys) - hit


def _drained(client: Any, poll_s: float = 0.05) -> dict[str, Any]:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        s = client.stats()["storage"]
        if s["spills_pending"] == 0 or time.monotonic() > deadline:
            return s
        time.sleep(poll_s)


def measure(policy: str, args: argparse.Namespace, eviction: str = "lru") -> dict[str, Any]:
    from hpkv.client import connect
    from hpkv.protocol.keys import namespace_fingerprint
    from hpkv.testing.server import ServerProcess, private_env

    storage = tempfile.mkdtemp(prefix="hpkv-bench-admit-", dir=args.dir)
    fp = namespace_fingerprint({"bench": "admit", "run": uuid.uuid4().hex})
    shard = args.block_kib << 10
    env = private_env(
        pool_size=args.pool,
        storage=storage,
        HPKV_STORAGE_ADMIT=policy,
        HPKV_DRAM_EVICTION=eviction,
        HPKV_STORAGE_LOOKUP_WAIT_MS="1000",
    )
    system = [b"system-%d" % i for i in range(args.system_blocks)]
    history: list[list[bytes]] = [[] for _ in range(args.users)]
    out: dict[str, Any] = {"policy": policy, "eviction": eviction}
    t0 = time.perf_counter()
    try:
        srv = ServerProcess(env).start()
        try:
            with connect(srv.cfg, spawn=False, call_timeout=60.0) as c:
                t = _Traffic(c, c.attach_namespace(fp, 1, shard, name="bench-admit").ns_id, fp, args.settle)
                for turn in range(args.turns):
                    for u in range(args.users):
                        msg = [b"user-%d-turn-%d-%d" % (u, turn, i) for i in range(args.turn_blocks)]
                        t.request(system + history[u] + msg)
                        history[u] += msg
                    for i in range(args.one_shots):
                        t.request([b"once-%d-%d-%d" % (turn, i, j) for j in range(args.one_shot_blocks)])
                s = _drained(c)
                out.update(t.counts)
                out["bytes_written"] = s["bytes_written"]
                out["bytes_promoted"] = t.counts["storage_hits"] * shard
                out["files"] = s["files"]
                out["admit_deferred"], out["admitted"] = s["admit_deferred"], s["admitted"]
        finally:
            srv.stop()
        out["seconds"] = round(time.perf_counter() - t0, 2)
        # Restart: an empty pool; each user sends one more turn.
        srv = ServerProcess(env).start()
        try:
            with connect(srv.cfg, spawn=False, call_timeout=60.0) as c:
                t = _Traffic(c, c.attach_namespace(fp, 1, shard, name="bench-admit").ns_id, fp)
                for u in range(args.users):
                    t.request(system + history[u] + [b"user-%d-after-restart-%d" % (u, i) for i in range(4)])
                out["after_restart"] = t.counts
        finally:
            srv.cleanup()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return out


def _ratio(r: dict[str, Any]) -> float:
    return (r["dram_hits"] + r["storage_hits"]) / max(r["blocks"], 1)


def _names(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def run(args: argparse.Namespace) -> int:
    rows = [measure(p, args, e) for p in _names(args.policies) for e in _names(args.evictions)]
    if args.json:
        print(json.dumps({"workload": {k: v for k, v in vars(args).items() if k != "func"}, "runs": rows}))
        return 0
    print(
        f"hpkv bench admit: {args.users} users x {args.turns} turns, a {args.system_blocks}-block system "
        f"prompt, {args.turn_blocks} blocks a turn, {args.one_shots} one-shot prompts a round; "
        f"{args.block_kib} KiB blocks, a {args.pool} pool"
    )
    print(
        f"{'admit':>10} {'eviction':>8} {'hit ratio':>9} {'DRAM ratio':>10} {'DRAM hits':>9} {'storage':>8} "
        f"{'recomp.':>8} {'MiB written':>11} {'MiB promoted':>12} {'files':>6} {'after restart: hit ratio':>25}"
    )
    for r in rows:
        print(
            f"{r['policy']:>10} {r['eviction']:>8} {_ratio(r):>9.3f} "
            f"{r['dram_hits'] / max(r['blocks'], 1):>10.3f} {r['dram_hits']:>9} {r['storage_hits']:>8} "
            f"{r['recomputed']:>8} {r['bytes_written'] / 2**20:>11.1f} {r['bytes_promoted'] / 2**20:>12.1f} "
            f"{r['files']:>6} {_ratio(r['after_restart']):>25.3f}"
        )
    return 0
