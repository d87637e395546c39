"""``hpkv bench ttft``: CT-HPKV's four-tier TTFT experiment, orchestrated against real vLLM.

CT-HPKV's published run (Qwen2.5-7B, 8192-token prompts ``"<L> " * 8192`` for
letters A..J, ``max_tokens=1``, 10 requests per phase, TTFT = time to the first
byte of a non-streaming completion) has four phases: cold prefill, GPU prefix
cache hit, DRAM hit after ``POST /reset_prefix_cache``, and storage hit after
restarting the engine. We run the same phases, plus a cold phase with hpkv off
as the baseline, and read hpkv's own counters to show which tier served each
phase. With ``--url`` only the request phases run, against a server you started
(as the seed's shell script does): cold, GPU hit, and DRAM hit if the server
runs with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXY"
WARMUP_LETTER = "Z"  # never measured
WARMUP_TOKENS = 2304  # > vLLM's default prefill chunk (2048 tokens)
PHASES = ("cold_no_hpkv", "cold", "gpu_hit", "dram_hit", "storage_hit")
PUBLISHED = {"cold": 0.701, "gpu_hit": 0.046, "dram_hit": 0.128, "storage_hit": 0.369}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the generated tiny Qwen2 model)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens (default 8192)")
    p.add_argument("--requests", type=int, default=10, help="requests per phase (default 10, at most 26)")
    p.add_argument("--url", help="benchmark an already running vLLM server instead of starting one")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the vLLM servers the benchmark starts (repeatable)",
    )
    p.add_argument("--keep", action="store_true", help="keep the benchmark's pool and storage directories")
    p.add_argument(
        "--top-frame",
        action="store_true",
        help="print one hpkv-top frame (hpkv-top --once) after the storage phase",
    )


def prompt_for(letter: str, tokens: int) -> str:
    """The seed's prompt: ``"<L> "`` repeated; one token per letter with the generated tokenizer."""
    return (f"{letter} " * tokens).rstrip()


def ttft(url: str, model: str, prompt: str, timeout: float = 600.0) -> float:
    """Seconds to the first byte of a non-streaming completion (curl's time_starttransfer)."""
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as r:
        r.raw.read(1)
        elapsed = time.perf_counter() - t0
        rest = r.raw.read()
        if r.status_code != 200:
            raise RuntimeError(f"completion failed with HTTP {r.status_code}: {rest[:300]!r}")
    return elapsed


def run_phase(url: str, model: str, letters: str, tokens: int) -> list[float]:
    return [ttft(url, model, prompt_for(letter, tokens)) for letter in letters]


def reset_prefix_cache(url: str) -> None:
    import requests

    r = requests.post(f"{url}/reset_prefix_cache", timeout=120)
    if r.status_code != 200:
        raise RuntimeError(
            f"POST /reset_prefix_cache returned HTTP {r.status_code}; start vLLM with "
            "VLLM_SERVER_DEV_MODE=1 to expose it"
        )


# CT-HPKV's own --kv-transfer-config (no module path: hpkv's vLLM plugin registers the name).
def run_orchestrated(args: argparse.Namespace) -> dict[str, Any]:
    from hpkv.testing.model import generate_model
    from hpkv.testing.server import env_without_hpkv
    from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, hpkv_loads

    model = args.model or generate_model()
    letters = LETTERS[: args.requests]
    work = tempfile.mkdtemp(prefix="hpkv-bench-ttft-", dir=os.environ.get("HPKV_BENCH_DIR", "/var/tmp"))
    pool_dir = f"/dev/shm/hpkv-bench-{os.getpid()}"
    cfg_file = os.path.join(work, "config.ini")
    with open(cfg_file, "w") as f:
        f.write("# hpkv bench ttft: private pool and storage\n")
    env = env_without_hpkv()
    pool_bytes = max(1 << 30, int(args.tokens * len(letters) * 4096 * 1.5))  # tiny model: 4 KiB/token
    env.update(
        HPKV_CONFIG_FILE_PATH=cfg_file,
        HPKV_SHARE_MEM_FILE_PATH=pool_dir,
        HPKV_KV_STORAGE_PATH=os.path.join(work, "storage"),
        HPKV_KV_MEM_POOL_SIZE=str(pool_bytes),
        HPKV_SERVER_IDLE_EXIT="30",
    )
    max_len = max(16384, args.tokens + 64)
    extra = ["--max-model-len", str(max_len), *args.vllm_arg]
    results: dict[str, Any] = {"model": model, "tokens": args.tokens, "requests": len(letters)}
    times: dict[str, list[float]] = {}
    served: dict[str, dict[str, int]] = {}

    def log(msg: str) -> None:
        print(f"[bench ttft] {msg}", file=sys.stderr, flush=True)

    def start(hpkv: bool, tag: str) -> VllmServer:
        e = dict(env)
        args_ = list(extra)
        if hpkv:
            args_ += ["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG]
        else:
            e["VLLM_ENABLE_HPKV"] = "0"
        log(f"starting vLLM ({tag}) ...")
        t0 = time.monotonic()
        srv = VllmServer(
            model,
            extra_args=args_,
            env=e,
            dev_mode=True,
            max_model_len=max_len,
            log_path=os.path.join(work, f"vllm-{tag}.log"),
        ).start()
        srv.wait_ready()
        log(f"vLLM ready in {time.monotonic() - t0:.0f}s; warm-up request (letter {WARMUP_LETTER})")
        # The first long prompt compiles the prefill-chunk kernels; keep that out of the
        # phases. A bit more than one chunk is enough, and cheap next to a full prompt.
        # Sent twice: the repeat is a hit, which compiles the short-step kernels every hit
        # phase needs (its tail is one block, like theirs).
        for _ in range(2):
            ttft(srv.url, srv.model_name, prompt_for(WARMUP_LETTER, min(args.tokens, WARMUP_TOKENS)))
        return srv

    def phase(name: str, srv: VllmServer) -> None:
        before = hpkv_loads(env)
        log(f"phase {name}: {len(letters)} request(s) of {args.tokens} tokens")
        times[name] = run_phase(srv.url, srv.model_name, letters, args.tokens)
        after = hpkv_loads(env)
        served[name] = {t: after[t] - before[t] for t in ("dram", "storage")}
        log(f"phase {name}: mean TTFT {statistics.mean(times[name]):.3f}s; hpkv served {served[name]}")

    try:
        srv = start(hpkv=False, tag="baseline")
        try:
            phase("cold_no_hpkv", srv)
        finally:
            srv.stop()
        srv = start(hpkv=True, tag="hpkv")
        try:
            phase("cold", srv)
            phase("gpu_hit", srv)
            reset_prefix_cache(srv.url)
            phase("dram_hit", srv)
        finally:
            srv.stop()
        # A restarted engine finds a restarted hpkv: its DRAM pool is gone, the files are not.
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=60)
        srv = start(hpkv=True, tag="hpkv-restarted")
        try:
            phase("storage_hit", srv)
            if args.top_frame:
                top = subprocess.run(
                    [sys.executable, "-m", "hpkv.monitor.top", "--once"],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                results["top_frame"] = top.stdout or top.stderr
        finally:
            srv.stop()
    finally:
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(pool_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work} and {pool_dir}")
    results["ttft"] = times
    results["served_tokens"] = served
    return results


def run_url(args: argparse.Namespace) -> dict[str, Any]:
    import requests

    url = args.url.rstrip("/")
    model = args.model or requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    letters = LETTERS[: args.requests]
    times = {
        "cold": run_phase(url, model, letters, args.tokens),
        "gpu_hit": run_phase(url, model, letters, args.tokens),
    }
    try:
        reset_prefix_cache(url)
        times["dram_hit"] = run_phase(url, model, letters, args.tokens)
    except RuntimeError as exc:
        print(f"[bench ttft] skipping the DRAM phase: {exc}", file=sys.stderr)
    return {
        "model": model,
        "tokens": args.tokens,
        "requests": len(letters),
        "ttft": times,
        "served_tokens": {},
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t = res["ttft"]
    out: dict[str, Any] = {f"{p}_s": round(statistics.mean(t[p]), 4) for p in PHASES if p in t}
    served = res.get("served_tokens", {})
    out["dram_loaded_tokens"] = served.get("dram_hit", {}).get("dram", 0)
    out["storage_loaded_tokens"] = served.get("storage_hit", {}).get("storage", 0)
    out.update(
        tokens=res["tokens"], requests=res["requests"], model=res["model"], ttft_all=t, served_tokens=served
    )
    return out


def print_table(s: dict[str, Any]) -> None:
    cold = s.get("cold_s")
    labels = {
        "cold_no_hpkv": "cold prefill, hpkv off",
        "cold": "cold prefill (hpkv saves)",
        "gpu_hit": "GPU prefix-cache hit",
        "dram_hit": "DRAM hit (after /reset_prefix_cache)",
        "storage_hit": "storage hit (after restart)",
    }
    print(
        f"CT-HPKV TTFT experiment: {s['requests']} request(s) per phase, {s['tokens']}-token prompts, "
        f"max_tokens=1, model {os.path.basename(str(s['model']))}"
    )
    print(
        f"{'phase':38} {'mean TTFT':>10} {'speedup':>8} {'hpkv DRAM tok':>14} {'hpkv disk tok':>14}"
        f" {'CT-HPKV':>8}   [each request, s]"
    )
    for p in PHASES:
        if f"{p}_s" not in s:
            continue
        v = s[f"{p}_s"]
        speed = f"{cold / v:.2f}x" if cold else "-"
        srv = s["served_tokens"].get(p, {})
        pub = PUBLISHED.get(p)
        print(
            f"{labels[p]:38} {v:>9.3f}s {speed:>8} {srv.get('dram', 0):>14} {srv.get('storage', 0):>14}"
            f" {f'{pub:.3f}s' if pub else '':>8}   [{', '.join(f'{t:.3f}' for t in s['ttft_all'][p])}]"
        )
    if "gpu_hit_s" in s:
        g = s["gpu_hit_s"]
        checks = [
            ("dram_hit_s <= 1.25 x gpu_hit_s", s.get("dram_hit_s"), 1.25 * g),
            ("storage_hit_s <= 1.6 x gpu_hit_s", s.get("storage_hit_s"), 1.6 * g),
            (
                "cold_s <= 1.05 x cold_no_hpkv_s",
                s.get("cold_s"),
                1.05 * s["cold_no_hpkv_s"] if "cold_no_hpkv_s" in s else None,
            ),
        ]
        for label, value, bound in checks:
            if value is not None and bound is not None:
                print(f"  {label}: {value:.3f} vs {bound:.3f} -> {'met' if value <= bound else 'NOT met'}")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.requests <= len(LETTERS):
        print(f"hpkv bench ttft: --requests must be 1..{len(LETTERS)}", file=sys.stderr)
        return 2
    res = run_url(args) if args.url else run_orchestrated(args)
    s = summarize(res)
    if args.json:
        print(json.dumps(s))
    else:
        print_table(s)
        if res.get("top_frame"):
            print("\nhpkv-top --once, after the storage phase:\n" + res["top_frame"])
    return 0
