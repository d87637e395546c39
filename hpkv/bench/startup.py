"""``hpkv bench startup``: how much later vLLM is ready with hpkv, and how soon hpkv's workers are.

vLLM is started with CT-HPKV's command line, alternately with hpkv disabled
(``VLLM_ENABLE_HPKV=0``: the connector stays configured, so vLLM binds its cores the
same way) and enabled, with a fresh pool directory each time so the connector
auto-spawns a server with the configured pool (by default the documented 8 GiB). A
first, unmeasured start fills vLLM's compile cache. Reported per round: seconds from
launch to ``/health`` answering; from server.log, how soon the server served and its IO
workers were ready, and how soon after vLLM registered its KV cache the transfer
worker was; and the CPU seconds hpkv's processes had used by the time vLLM answered
(on a machine whose cores vLLM keeps busy while it starts, roughly what hpkv adds).
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
    """From server.log: seconds from the server's first line to 'serving' and to its last IO
    worker's 'ready', and from the device registration to the transfer worker's 'ready'."""
    first = serving = io_ready = registered = transfer_ready = None
    with open(path) as f:
        for line in f:
            m = _STAMP.match(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            first = first if first is not None else t
            if "hpkv.server" in line and " serving " in line:
                serving = t
            elif "IO worker ready" in line:
                io_ready = t
            elif "registered device" in line and registered is None:
                registered = t
            elif "transfer worker ready" in line:
                transfer_ready = t
    out: dict[str, float] = {}
    if first is not None and serving is not None:
        out["server_serving_s"] = round(serving - first, 3)
    if first is not None and io_ready is not None:
        out["io_workers_ready_s"] = round(io_ready - first, 3)
    if registered is not None and transfer_ready is not None:
        out["transfer_ready_after_registration_s"] = round(transfer_ready - registered, 3)
    return out


def _hpkv_cpu_s(pool_dir: str) -> dict[str, float]:
    """CPU seconds used so far by the pool directory's server and its workers, per process name."""
    import psutil

    from hpkv.engine.workers import WORKER_MODULES
    from hpkv.protocol.wire import live_server_pid

    kinds = {module: f"{kind}_workers" for kind, module in WORKER_MODULES.items()}

    pid = live_server_pid(pool_dir)
    if pid is None:
        return {}
    out: dict[str, float] = {}
    try:
        server = psutil.Process(pid)
        procs = [server, *server.children(recursive=True)]
    except psutil.Error:
        return {}
    for p in procs:
        try:
            t = p.cpu_times()
            cmd = p.cmdline()
            name = "server" if p.pid == pid else (cmd[2] if len(cmd) > 2 else p.name())
        except psutil.Error:
            continue
        key = f"cpu_{kinds.get(name, name)}_s"
        out[key] = round(out.get(key, 0.0) + t.user + t.system, 2)
    out["cpu_hpkv_s"] = round(sum(out.values()), 2)
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
            srv.start().wait_ready(timeout=900, poll_s=0.2)
            row: dict[str, Any] = {"run": tag, "hpkv": hpkv, "ready_s": round(time.monotonic() - t0, 2)}
            if hpkv:
                row.update(_hpkv_cpu_s(pool_dir))
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
