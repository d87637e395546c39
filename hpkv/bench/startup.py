"""``hpkv bench startup``: how much later vLLM is ready with hpkv, and how soon hpkv's workers are.

vLLM is started with CT-HPKV's command line, alternately with hpkv disabled
(``VLLM_ENABLE_HPKV=0``: the connector stays configured, so vLLM binds its cores the
same way) and enabled, with a fresh pool directory each time so the connector
auto-spawns a server with the configured pool (by default the documented 8 GiB). A
first, unmeasured start fills vLLM's compile cache. Reported per round: seconds from
launch to ``/health`` answering, and from the hpkv server's first log line to its
``serving`` line and to its last worker's ``ready`` line (server.log).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the generated tiny Qwen2 model)")
    p.add_argument("--rounds", type=int, default=2, help="measured (off, on) pairs (default 2)")
    p.add_argument("--pool-size", help="HPKV_KV_MEM_POOL_SIZE (default: hpkv's default, 8g)")


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _log_times(path: str) -> dict[str, float]:
    """Seconds from the server's first log line to 'serving' and to the last worker 'ready'."""
    first = serving = ready = None
    with open(path) as f:
        for line in f:
            m = _STAMP.match(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            first = first if first is not None else t
            if "hpkv.server" in line and " serving " in line:
                serving = t
            if "worker ready" in line:
                ready = t
    out: dict[str, float] = {}
    if first is not None and serving is not None:
        out["server_serving_s"] = round(serving - first, 3)
    if first is not None and ready is not None:
        out["workers_ready_s"] = round(ready - first, 3)
    return out


def run(args: argparse.Namespace) -> int:
    from hpkv.testing.model import generate_model
    from hpkv.testing.server import env_without_hpkv
    from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer

    model = args.model or generate_model()
    work = tempfile.mkdtemp(prefix="hpkv-bench-startup-", dir=os.environ.get("HPKV_BENCH_DIR", "/var/tmp"))
    env = env_without_hpkv()
    env.update(
        HPKV_CONFIG_FILE_PATH=os.path.join(work, "none.ini"),
        HPKV_KV_STORAGE_PATH=os.path.join(work, "storage"),
    )
    with open(env["HPKV_CONFIG_FILE_PATH"], "w") as f:
        f.write("# hpkv bench startup: configured through the environment\n")
    if args.pool_size:
        env["HPKV_KV_MEM_POOL_SIZE"] = args.pool_size
    rows: list[dict[str, Any]] = []

    def once(tag: str, hpkv: bool) -> dict[str, Any]:
        pool_dir = f"/dev/shm/hpkv-bench-startup-{os.getpid()}-{tag}"
        e = {**env, "HPKV_SHARE_MEM_FILE_PATH": pool_dir}
        if not hpkv:
            e["VLLM_ENABLE_HPKV"] = "0"
        srv = VllmServer(
            model,
            extra_args=["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG],
            env=e,
            dev_mode=True,
            max_model_len=4096,
            log_path=os.path.join(work, f"vllm-{tag}.log"),
        )
        t0 = time.monotonic()
        try:
            srv.start().wait_ready(timeout=900)
            row: dict[str, Any] = {"run": tag, "hpkv": hpkv, "ready_s": round(time.monotonic() - t0, 2)}
            srv.interrupt()
        finally:
            srv.stop()
            subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=e, capture_output=True, timeout=180)
        log = os.path.join(pool_dir, "server.log")
        if hpkv and os.path.exists(log):
            row.update(_log_times(log))
        shutil.rmtree(pool_dir, ignore_errors=True)
        print(f"[bench startup] {row}", file=sys.stderr, flush=True)
        return row

    try:
        once("warmup", hpkv=False)
        for i in range(args.rounds):
            rows.append(once(f"off{i}", hpkv=False))
            rows.append(once(f"on{i}", hpkv=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    off = [r["ready_s"] for r in rows if not r["hpkv"]]
    on = [r["ready_s"] for r in rows if r["hpkv"]]
    summary = {
        "rounds": rows,
        "ready_off_s": statistics.median(off),
        "ready_on_s": statistics.median(on),
        "added_s": round(statistics.median(on) - statistics.median(off), 2),
        "pool_size": args.pool_size or "8g (default)",
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for r in rows:
            print(r)
        print(
            f"vLLM ready: {summary['ready_off_s']:.1f}s without hpkv, {summary['ready_on_s']:.1f}s with "
            f"(median): hpkv adds {summary['added_s']:+.1f}s; pool {summary['pool_size']}"
        )
    return 0
