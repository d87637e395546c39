"""``hpkv bench ttft``: CT-HPKV's four-tier TTFT experiment, orchestrated against real vLLM.

CT-HPKV's published run (Qwen2.5-7B, 8192-token prompts ``"<L> " * 8192`` for
letters A..J, ``max_tokens=1``, 10 requests per phase, TTFT = time to the first
byte of a non-streaming completion) has four phases: cold prefill, GPU prefix
cache hit, DRAM hit after ``POST /reset_prefix_cache``, and storage hit after
restarting the engine. We run the same phases, plus a cold phase with hpkv off
as the baseline, and read hpkv's own counters to show which tier served each
phase.

Honest by construction: the prompt is the seed's exact bytes (every letter followed by a
space, the last one too, so the last block is partial and every hit phase computes only that
tail); ``--shape qwen2.5-7b`` generates a model with Qwen2.5-7B's KV shape (56 KiB per
token); the pool is sized from the model's bytes per token. The baseline runs on the same
vLLM engine as hpkv: each cold prompt is paired with the same prompt in lowercase letters
(as many tokens) sent with ``kv_transfer_params`` ``{"hpkv_skip": true}``, which hpkv
neither looks up nor saves, one right after the other; cold with hpkv / baseline is the mean
of the baseline-first and the hpkv-first pairs' median ratios. Two engine instances differ
by up to 15% in prefill speed on this VM (two of them side by side: one ran every prompt
0.85x the other's time), and the machine's speed drifts between minutes: neither moves a
pair. What the engine-wide set-up costs (the KV cache in a shared-memory file, the
connector's hooks each step) is in both halves; ``--no-connector-too`` adds a cold phase on
an engine with no connector at all. SGLang has no per-request switch: its baseline is a
second SGLang with ``VLLM_ENABLE_HPKV=0``, run before. Hit phases start once hpkv's write-
through has finished. Beside each hit phase the time hpkv adds is set against the physical
floor for the same bytes, measured in the same run. The time added is the median over the
phase's prompts of (hit − the same prompt sent again right after it, a GPU prefix-cache
hit): pairs a second apart, so a shared machine whose speed drifts between phases does not
move it. The floor is the best memcpy between two shared-memory mappings on the CPUs the
engine leaves free during the load (its CPU seconds beyond the GPU hit's tell how many it
kept busy; the floor on every CPU is printed beside), and the best raw O_DIRECT read of the
KV files written (1..8 threads).

``--remote`` adds two phases on two Mooncake Store nodes in network namespaces (``--remote-only``:
only them; :func:`remote_phases`): node A computes the prompts and publishes their blocks, node
B's engine, its hpkv empty, hits them in the store; the time the hit adds to a GPU hit is set
against the raw ``batch_get_into`` time of the same bytes, measured from node B in the same run.

With ``--url`` only the request phases run, against a server you started
(as the seed's shell script does): cold, GPU hit, and DRAM hit if the server
runs with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpkv.bench import order_balanced
from hpkv.bench.floors import machine_busy_s

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXY"
WARMUP_LETTER = "Z"  # never measured
INTERFERENCE_HIT, INTERFERENCE_COLD = "Y", "X"  # --interference: never among the measured letters
WARMUP_TOKENS = 2304  # > vLLM's default prefill chunk (2048 tokens)
COLD_SETTLE_S = 1.0  # after a cold prompt, before the next: the engine's OpenMP threads go idle
READY_TIMEOUT_S = 1200.0  # the first start at a new model shape compiles (minutes on a busy 2-core machine)
PHASES = (
    "cold_no_connector",
    "cold_no_hpkv",
    "cold",
    "gpu_hit",
    "dram_hit",
    "storage_hit",
    "remote_cold",
    "remote_hit",
)
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
    # Gemma-3-4B's KV: 34 layers, every 6th full attention (5), the others a sliding window of
    # 1024 tokens (29), 4 KV heads x 256, bf16 = 136 KiB per token if every layer kept every
    # token; hpkv stores the sliding groups' windows only (`hpkv bench window`: 282 MiB for an
    # 8192-token prompt against 1088 MiB of a full-attention model of that size).
    "gemma3": dict(
        kind="gemma3",
        hidden_size=512,
        num_layers=34,
        num_attention_heads=8,
        num_kv_heads=4,
        attention_head_dim=256,
        intermediate_size=1024,
        sliding_window=1024,
        full_attention_every=6,
        max_position_embeddings=16384,
    ),
    # gpt-oss-20b's KV: 24 layers alternating a 128-token window and full attention (with
    # attention sinks), 8 KV heads x 64, bf16 = 48 KiB per token if every layer kept every
    # token; its 12 window layers store 128 tokens each.
    "gpt-oss-20b": dict(
        kind="gpt_oss",
        hidden_size=512,
        num_layers=24,
        num_attention_heads=8,
        num_kv_heads=8,
        attention_head_dim=64,
        intermediate_size=1024,
        sliding_window=128,
        full_attention_every=2,
        max_position_embeddings=16384,
    ),
    # Qwen3-Next-80B-A3B's cache: 48 layers, every 4th full attention (12, 2 KV heads x 256,
    # bf16: 24 KiB per token), the others gated delta net layers (16 key and 32 value heads of
    # 128) whose recurrent state, 1 MiB a layer, is saved once per block where vLLM's mamba
    # align mode keeps it.
    "qwen3-next": dict(
        kind="qwen3_next",
        hidden_size=512,
        num_layers=48,
        num_attention_heads=8,
        num_kv_heads=2,
        attention_head_dim=256,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_head_dim=128,
        intermediate_size=1024,
        full_attention_every=4,
        max_position_embeddings=16384,
    ),
}
BASELINE = {
    "vllm": "the same vLLM engine: each cold prompt paired with the same prompt in lowercase letters "
    "sent with kv_transfer_params hpkv_skip (hpkv neither looks it up nor saves it)",
    "sglang": "the same SGLang with --enable-ct-hpkv (HiCache L1+L2) and VLLM_ENABLE_HPKV=0",
}
PUBLISHED = {"cold": 0.701, "gpu_hit": 0.046, "dram_hit": 0.128, "storage_hit": 0.369}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: a generated model of --shape)")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="shape of the generated model: tiny (4 KiB/token), qwen2.5-7b (56 KiB/token), gemma3 "
        "(Gemma-3-4B's hybrid KV: 5 full-attention layers and 29 of a 1024-token window), "
        "gpt-oss-20b (12 full-attention layers and 12 of a 128-token window, attention sinks), or "
        "qwen3-next (12 full-attention layers, 36 gated delta net layers whose state is saved per block)",
    )
    p.add_argument(
        "--interference",
        action="store_true",
        help="also measure a streaming client's inter-token gaps during a storage hit, DRAM hits (in the step "
        "and as HPKV_ASYNC_DRAM_LOADS has it) and a write-through",
    )
    p.add_argument(
        "--no-connector-too",
        action="store_true",
        help="also run a cold phase with no KV connector configured at all (not like for like)",
    )
    p.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens (default 8192)")
    p.add_argument(
        "--requests",
        type=int,
        default=10,
        help="requests per phase (default 10, at most 25; 23 with --interference)",
    )
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
        "--remote",
        action="store_true",
        help="after the storage phase, two nodes on Mooncake Store (network namespaces, root): node A's engine "
        "computes the prompts, node B's, with empty local tiers, hits them in the store (remote hit), set "
        "against the raw batch_get_into time of the same bytes",
    )
    p.add_argument(
        "--remote-only",
        action="store_true",
        help="run only --remote's two phases (no single-node phases)",
    )
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
    return first_byte(url, model, prompt, timeout=timeout)[0]


def first_byte(
    url: str, model: str, prompt: str, extra: dict[str, Any] | None = None, timeout: float = 600.0
) -> tuple[float, int | None]:
    """:func:`ttft` of a completion whose body has ``extra`` too, and the prompt's tokens as the
    server counted them (None when the response says nothing)."""
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **(extra or {})}
    t0 = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as r:
        first = r.raw.read(1)
        elapsed = time.perf_counter() - t0
        rest = first + r.raw.read()
        if r.status_code != 200:
            raise RuntimeError(f"completion failed with HTTP {r.status_code}: {rest[:300]!r}")
    try:
        return elapsed, int(json.loads(rest)["usage"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError):
        return elapsed, None


def run_phase(
    url: str,
    model: str,
    letters: str,
    tokens: int,
    repeats: list[float] | None = None,
    while_repeating: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> list[float]:
    """TTFT of each letter's prompt. With ``repeats``, each prompt is sent again right after
    it (then a GPU prefix-cache hit) inside ``while_repeating()``, its TTFT appended there.
    Back to back: each window takes the other's wind-down (the engine's threads spin on
    for a while after a step), so the two kinds of windows get alike amounts of it. Waiting
    out each wind-down inside its own window instead added ~0.3 CPU-s of spinning to both,
    whose spread swamped the ~0.02 CPU-s the engine spends polling during a DRAM load."""
    times = []
    for letter in letters:
        prompt = prompt_for(letter, tokens)
        times.append(ttft(url, model, prompt))
        if repeats is not None:
            with while_repeating():
                repeats.append(ttft(url, model, prompt))
    return times


def cold_pair_order(letters: str) -> list[tuple[str, str]]:
    """(phase, letter) in the order the paired cold phases send them: each letter's pair, the
    baseline half first for even pairs and hpkv's first for odd ones."""
    out = []
    for i, letter in enumerate(letters):
        pair = [("cold_no_hpkv", letter), ("cold", letter)]
        out += pair[::-1] if i % 2 else pair
    return out


def cold_vs_baseline(ttfts: dict[str, list[float]], paired: bool) -> float | None:
    """Cold TTFT with hpkv over the baseline's: when the phases were paired (see
    :func:`cold_pair_order`), the mean of the per-prompt ratios' medians over each order,
    else the ratio of the phases' means."""
    hpkv, base = ttfts.get("cold"), ttfts.get("cold_no_hpkv")
    if not hpkv or not base:
        return None
    if not paired:
        return statistics.mean(hpkv) / statistics.mean(base)
    # With 3 pairs, 2 go baseline first: an order effect must not pass for hpkv's.
    return order_balanced([h / b for b, h in zip(base, hpkv, strict=True)])


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


def transfer_busy_s(pool_dir: str) -> dict[int, float]:
    """Seconds each of hpkv's transfer workers (by stats slot) has spent copying between an
    engine's KV cache and the pool, from the stats segment in this process (empty without a
    server)."""
    from hpkv.protocol.stats import StatsSegment

    try:
        seg = StatsSegment.attach(pool_dir)
    except FileNotFoundError:
        return {}
    try:
        return {
            w["slot"]: w["busy_ns"] / 1e9 for w in seg.snapshot()["workers"] if w.get("kind") == "transfer"
        }
    finally:
        seg.close()


def busiest_since(before: dict[int, float], now: dict[int, float]) -> float:
    """The most any one transfer worker copied between two :func:`transfer_busy_s` readings:
    workers of several ranks copy side by side, so the engine waits for the longest."""
    return max((v - before.get(k, 0.0) for k, v in now.items()), default=0.0)


def storage_files(storage: str) -> list[str]:
    from hpkv.io_workers import kvfile

    return [
        os.path.join(d, f)
        for d, _, files in os.walk(storage)
        if kvfile.QUARANTINE_DIR not in d
        for f in files
        if kvfile.parse_name(f) is not None
    ]


def _tree_cpu_s(pid: int | None, seen: dict[int, float] | None = None) -> float:
    """CPU seconds used so far by process ``pid`` and its descendants (0 when it is gone).

    From their threads' ``schedstat`` (nanoseconds) where the kernel keeps it: the clock-tick
    counts of ``/proc/PID/stat`` move in 10 ms steps per process, as much as a DRAM hit adds.
    A thread that has ended is no longer listed: with ``seen`` (thread id -> its last reading,
    kept by the caller across calls) it still counts with what it had run when last seen,
    so a total never goes back."""
    import psutil

    if pid is None:
        return sum(seen.values()) if seen else 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = []
    total = 0.0
    live: dict[int, float] = {}
    for p in procs:
        threads = _threads_run_s(p.pid)
        if threads is not None:
            live.update(threads)
            continue
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    if seen is None:
        return total + sum(live.values())
    seen.update(live)
    return total + sum(seen.values())


def _threads_run_s(pid: int) -> dict[int, float] | None:
    """Seconds each thread of ``pid`` has run (``/proc/PID/task/*/schedstat``); None where the
    kernel keeps no such count (the file is missing or reads all zero) or the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: dict[int, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out if any(out.values()) else None


class CpuMeter:
    """CPU seconds per request of the engine's processes and of hpkv's (server and workers), per
    phase: hpkv's cost in the cold phase as a share of the engine's, which the noise of a
    shared machine hides in wall-clock ratios."""

    def __init__(self, pool_dir: str, requests: int) -> None:
        self.pool_dir, self.requests = pool_dir, requests
        self.started: dict[str, dict[str, float]] = {}
        self.per_request: dict[str, dict[str, float]] = {}
        self._into: dict[str, dict[str, float]] = {}  # paused CPU counted elsewhere, unrounded
        self._seen: dict[str, dict[int, float]] = {"engine": {}, "hpkv": {}}  # see _tree_cpu_s

    def _now(self, engine_pid: int | None) -> dict[str, float]:
        from hpkv.protocol.wire import live_server_pid

        # hpkv's workers are the server's children; the auto-spawned server is no engine's
        return {
            "engine": _tree_cpu_s(engine_pid, self._seen["engine"]),
            "hpkv": _tree_cpu_s(live_server_pid(self.pool_dir), self._seen["hpkv"]),
            "machine": machine_busy_s(),  # everything: other nodes, the kernel, the benchmark
        }

    def start(self, phase: str, engine_pid: int | None) -> None:
        self.started[phase] = self._now(engine_pid)

    @contextlib.contextmanager
    def paused(self, phase: str, engine_pid: int | None, into: str | None = None) -> Iterator[None]:
        """Leave the CPU used inside out of the phase's window; with ``into``, count it there
        (per request of ``phase``, summed over the paused stretches)."""
        before = self._now(engine_pid)
        try:
            yield
        finally:
            now, started = self._now(engine_pid), self.started[phase]
            self.started[phase] = {k: started[k] + now[k] - before[k] for k in now}
            if into is not None:
                got = self._into.setdefault(into, dict.fromkeys(now, 0.0))
                for k in now:
                    got[k] += now[k] - before[k]
                self.per_request[into] = {k: round(v / self.requests, 3) for k, v in got.items()}

    def stop(self, phase: str, engine_pid: int | None) -> None:
        """From :meth:`start` to now (a later call extends the window)."""
        now, then = self._now(engine_pid), self.started[phase]
        self.per_request[phase] = {k: round((now[k] - then[k]) / self.requests, 3) for k in now}


def baseline_prompt_for(letter: str, tokens: int) -> str:
    """The baseline half of a cold pair: the seed's prompt in the lowercase letter, as many
    tokens and never among the cached prompts."""
    return prompt_for(letter.lower(), tokens)


def paired_cold(
    srv: Any,
    letters: str,
    tokens: int,
    pool_dir: str,
    cpu: CpuMeter,
    loads: Callable[[], dict[str, int]],
) -> tuple[dict[str, list[float]], dict[str, int], dict[str, Any]]:
    """The cold phases with and without hpkv, paired on one engine. Each letter's prompt goes
    to the engine twice, one right after the other (which goes first alternates, see
    :func:`cold_pair_order`): the seed's prompt, which hpkv saves, and the baseline, the same
    prompt in lowercase (:func:`baseline_prompt_for`) with ``kv_transfer_params``
    ``{"hpkv_skip": true}``, which hpkv neither looks up nor saves. The two halves differ only
    by hpkv's work for the request, and a machine whose speed drifts moves both alike. hpkv's
    write-through of each prompt finishes before the next request. Returns the TTFTs per phase,
    what hpkv served meanwhile (``loads`` reads its counters) and the results' extra keys."""
    from hpkv.connectors.vllm.scheduler import SKIP_PARAM

    _log(f"phases cold_no_hpkv and cold, paired: {len(letters)} prompt(s) of {tokens} tokens each")
    wait_for_write_through(pool_dir)  # the warm-up's
    before = loads()
    times: dict[str, list[float]] = {"cold_no_hpkv": [], "cold": []}
    prompt_tokens: dict[str, list[int | None]] = {name: [] for name in times}
    for name in times:
        cpu.start(name, srv.pid)
    write_through_s = 0.0
    save_s: list[float] = []
    for name, letter in cold_pair_order(letters):
        other = next(n for n in times if n != name)
        with cpu.paused(other, srv.pid):
            if name == "cold":
                busy = transfer_busy_s(pool_dir)
                t, n = first_byte(srv.url, srv.model_name, prompt_for(letter, tokens))
            else:
                body = {"kv_transfer_params": {SKIP_PARAM: True}}
                t, n = first_byte(srv.url, srv.model_name, baseline_prompt_for(letter, tokens), body)
            times[name].append(t)
            prompt_tokens[name].append(n)
            if name == "cold":
                write_through_s = max(write_through_s, wait_for_write_through(pool_dir))
                save_s.append(busiest_since(busy, transfer_busy_s(pool_dir)))
            time.sleep(COLD_SETTLE_S)  # the engine's compute threads stop spinning
    for name in times:
        cpu.stop(name, srv.pid)
    if prompt_tokens["cold"] != prompt_tokens["cold_no_hpkv"] or None in prompt_tokens["cold"]:
        raise RuntimeError(
            f"the baseline prompts are not as long as hpkv's (server's counts): {prompt_tokens}"
        )
    after = loads()
    ratios = [h / b for b, h in zip(times["cold_no_hpkv"], times["cold"], strict=True)]
    _log(f"paired cold: hpkv / baseline per prompt {', '.join(f'{r:.3f}' for r in ratios)}")
    extra = {
        "cold_paired": True,
        "write_through_wait_s": round(write_through_s, 2),
        # the transfer worker's save copies per cold request (submitted at the end of the step,
        # copied beside the engine's next one; the worker does not wait for them)
        "cold_save_ms": round(statistics.median(save_s) * 1000, 1),
    }
    return times, {t: after[t] - before[t] for t in ("dram", "storage")}, extra


def _check_gpu_hits(served: dict[str, int]) -> None:
    if any(served.values()):
        _log(f"warning: hpkv served {served} in the GPU-hit phase: vLLM's KV cache did not hold its prompts")


@contextlib.contextmanager
def _stopped_on_error(srv: Any) -> Iterator[None]:
    try:
        yield
    except BaseException:
        srv.stop()
        raise


def _on(srv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` where ``srv`` can be reached: inside its network namespace (a --remote
    node's engine, bound to the namespace's loopback) or here."""
    ns = getattr(srv, "netns", None)
    return ns.call(fn, *args) if ns is not None else fn(*args)


def remote_unavailable() -> str | None:
    """Why --remote's two nodes cannot run here (no root for network namespaces, no Mooncake)."""
    from hpkv.io_workers import mooncake_api
    from hpkv.testing import netns

    return netns.unavailable() or mooncake_api.unavailable()


def _wait_published(env: dict[str, str], blocks: int, timeout: float = 600.0) -> float:
    """Seconds until node ``env``'s hpkv has published (or found already published) ``blocks``
    blocks to the remote store."""
    from hpkv.testing.vllm_server import hpkv_status

    t0 = time.monotonic()
    while True:
        r = ((hpkv_status(env) or {}).get("storage") or {}).get("remote") or {}
        if r.get("published", 0) + r.get("existed", 0) >= blocks:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(
                f"node A published {r.get('published', 0)} of {blocks} blocks in {timeout:.0f} s: {r}"
            )
        time.sleep(0.2)


def warm_up(srv: Any, tokens: int) -> None:
    """The first long prompt compiles the prefill-chunk kernels; keep that out of the phases.
    A bit more than one chunk is enough, and cheap next to a full prompt. Sent twice: the
    repeat is a hit, which compiles the short-step kernels every hit phase needs (its tail is
    one partial block, like theirs)."""
    with _stopped_on_error(srv):
        for _ in range(2):
            _on(srv, ttft, srv.url, srv.model_name, prompt_for(WARMUP_LETTER, min(tokens, WARMUP_TOKENS)))


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
        from hpkv.testing.vllm_server import hpkv_loads

        _log(
            "interference: a streaming client alone, during a storage hit, during DRAM hits (in the "
            "step and as configured), during a write-through"
        )
        results["interference"] = measure(
            srv.url,
            srv.model_name,
            prompt_for(INTERFERENCE_HIT, args.tokens),
            prompt_for(INTERFERENCE_COLD, args.tokens),
            lambda: spills_pending(env["HPKV_SHARE_MEM_FILE_PATH"]),
            lambda prompt, extra: first_byte(srv.url, srv.model_name, prompt, extra)[0],
            lambda: reset_engine_cache(getattr(args, "engine", "vllm"), srv.url),
            lambda: hpkv_loads(env),
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


def reset_engine_cache(engine: str, url: str) -> None:
    """Drop the engine's own prefix cache, not hpkv's tiers (vLLM: /reset_prefix_cache; SGLang:
    /flush_cache, its device and host caches)."""
    if engine == "sglang":
        flush_cache(url)
    else:
        reset_prefix_cache(url)


def start_vllm(
    model: str,
    env: dict[str, str],
    tag: str,
    connector: bool,
    hpkv: bool,
    extra: list[str],
    max_len: int,
    kv_space_gib: int,
    work: str,
    netns: Any = None,
) -> Any:
    """A vLLM server for the experiment, ready: with CT-HPKV's ``--kv-transfer-config`` when
    ``connector``, hpkv turned off by ``VLLM_ENABLE_HPKV=0`` unless ``hpkv``."""
    from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer

    args = list(extra) + (["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG] if connector else [])
    _log(f"starting vLLM ({tag}) ...")
    t0 = time.monotonic()
    srv = VllmServer(
        model,
        extra_args=args,
        env=env if hpkv else {**env, "VLLM_ENABLE_HPKV": "0"},
        dev_mode=True,
        max_model_len=max_len,
        kv_cache_space_gib=kv_space_gib,
        log_path=os.path.join(work, f"vllm-{tag}.log"),
        netns=netns,
    ).start()
    with _stopped_on_error(srv):
        srv.wait_ready(timeout=READY_TIMEOUT_S)
    _log(f"vLLM ready in {time.monotonic() - t0:.0f}s")
    return srv


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


def hpkv_key_shape(env: dict[str, str]) -> dict[str, float] | None:
    """What one key hpkv's counters count holds, from its one namespace: ``block_tokens`` and
    ``loaded_bytes_per_token`` (shard bytes over block tokens). For a hybrid model a key is one
    KV cache group's block, so fewer bytes per token than the model's every layer; None unless
    exactly one namespace is in use."""
    from hpkv.testing.vllm_server import hpkv_status

    stats = hpkv_status(env)
    ns = [n for n in (stats or {}).get("namespaces", []) if n.get("block_tokens")]
    if len(ns) != 1:
        return None
    return {
        "block_tokens": ns[0]["block_tokens"],
        "loaded_bytes_per_token": ns[0]["shard_bytes"] / ns[0]["block_tokens"],
    }


def run_orchestrated(args: argparse.Namespace) -> dict[str, Any]:
    from hpkv.bench.floors import memcpy_gbps
    from hpkv.testing.model import generate_model
    from hpkv.testing.server import env_without_hpkv
    from hpkv.testing.vllm_server import VllmServer, hpkv_loads

    engine = getattr(args, "engine", "vllm")
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
        "baseline": BASELINE[engine],
        "cpus": len(os.sched_getaffinity(0)),
    }
    results.update({"engine": "sglang"} if engine == "sglang" else {})
    times: dict[str, list[float]] = {}
    served: dict[str, dict[str, int]] = {}
    cpu = CpuMeter(pool_dir, len(letters))

    log = _log

    def start(tag: str, connector: bool = True, hpkv: bool = True) -> VllmServer:
        if engine == "sglang":
            log(f"starting SGLang ({tag}) ...")
            srv = start_sglang(
                model, dict(env), hpkv, args.tokens, len(letters), os.path.join(work, f"sglang-{tag}.log")
            )
        else:
            srv = start_vllm(model, env, tag, connector, hpkv, extra, max_len, kv_space_gib, work)
        log(f"{engine} ready; warm-up request (letter {WARMUP_LETTER})")
        warm_up(srv, args.tokens)
        return srv

    def phase(
        name: str,
        srv: VllmServer,
        repeat: bool = False,
        node_env: dict[str, str] = env,
        meter: CpuMeter = cpu,
    ) -> None:
        """``repeat``: each prompt is sent again right after its hit (a GPU hit, timed in
        ``<name>_repeat`` and left out of the phase's CPU). ``node_env``/``meter``: a --remote
        node's hpkv and its CPU meter."""
        before = hpkv_loads(node_env, remote=True)
        log(f"phase {name}: {len(letters)} request(s) of {args.tokens} tokens")
        meter.start(name, srv.pid)
        repeats: list[float] = []
        times[name] = _on(
            srv,
            run_phase,
            srv.url,
            srv.model_name,
            letters,
            args.tokens,
            repeats if repeat else None,
            lambda: meter.paused(name, srv.pid, into=f"{name}_repeat"),
        )
        times.update({f"{name}_repeat": repeats} if repeats else {})
        meter.stop(name, srv.pid)
        cpu.per_request.update(meter.per_request)
        after = hpkv_loads(node_env, remote=True)
        served[name] = {t: after[t] - before[t] for t in ("dram", "storage", "remote")}
        log(f"phase {name}: mean TTFT {statistics.mean(times[name]):.3f}s; hpkv served {served[name]}")

    def one_phase_server(name: str, tag: str, **kw: bool) -> None:
        srv = start(tag, **kw)
        try:
            phase(name, srv)
        finally:
            srv.stop()

    def cold_phases() -> VllmServer:
        """The baseline's and hpkv's cold phases; returns the hpkv engine, still up."""
        if engine != "vllm":  # SGLang takes no per-request hpkv_skip: a second engine is the baseline
            one_phase_server("cold_no_hpkv", "baseline", hpkv=False)
            srv = start("hpkv")
            with _stopped_on_error(srv):
                phase("cold", srv)
                results["write_through_wait_s"] = round(wait_for_write_through(pool_dir), 2)
                cpu.stop("cold", srv.pid)  # again: hpkv's work for the cold phase ends with this
            return srv
        srv = start("hpkv")
        with _stopped_on_error(srv):
            pairs, served["cold"], extra = paired_cold(
                srv, letters, args.tokens, pool_dir, cpu, lambda: hpkv_loads(env)
            )
        times.update(pairs)
        results.update(extra)
        results.update(hpkv_key_shape(env) or {})
        return srv

    def single_node_phases() -> None:
        if args.no_connector_too:
            one_phase_server("cold_no_connector", "no-connector", connector=False, hpkv=False)
        srv = cold_phases()
        try:
            if args.interference:  # a prompt that the restarted engine finds on storage only
                ttft(srv.url, srv.model_name, prompt_for(INTERFERENCE_HIT, args.tokens))
                wait_for_write_through(pool_dir)
            # The baseline's prompts took room in vLLM's KV cache too: bring back any of the
            # phase's prompts it evicted (from hpkv), so that the GPU-hit phase hits on the GPU.
            for letter in letters:
                ttft(srv.url, srv.model_name, prompt_for(letter, args.tokens))
            phase("gpu_hit", srv)
            _check_gpu_hits(served["gpu_hit"])
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
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=600)

    try:
        remote = (model, extra, max_len, kv_space_gib)
        _run_phases(
            args,
            single_node_phases,
            functools.partial(remote_phases, args, env, work, prompt_bytes, results, served, remote, phase),
        )
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


def _run_phases(
    args: argparse.Namespace, single_node: Callable[[], None], two_nodes: Callable[[], None]
) -> None:
    """The single-node phases unless --remote-only, then --remote's two-node phases."""
    if not args.remote_only:
        single_node()
    if args.remote:
        two_nodes()


def remote_phases(
    args: argparse.Namespace,
    env: dict[str, str],
    work: str,
    prompt_bytes: int,
    results: dict[str, Any],
    served: dict[str, dict[str, int]],
    engine: tuple[str, list[str], int, int],
    phase: Callable[..., None],
) -> None:
    """--remote: two nodes on Mooncake Store in network namespaces, a master in the first.
    Node A's engine computes the prompts (``remote_cold``; its hpkv publishes the blocks and,
    started by the operator as ``hpkv serve``, outlives the engine, holding the segment they
    live in); node B's engine, its hpkv empty, hits them in the store (``remote_hit``, each
    prompt sent again right after: a GPU hit). Then the floor: the raw ``batch_get_into``
    rate from node B of as many bytes in objects of one block's image. ``engine``: vLLM's
    model, extra arguments, max model length and KV cache GiB."""
    why = remote_unavailable()
    if why:
        _log(f"skipping the remote phases: {why}")
        results["remote_skipped"] = why
        return
    from hpkv.bench.remote import raw_get_gbps
    from hpkv.io_workers.kvfile import file_size
    from hpkv.testing import mooncake as mc
    from hpkv.testing import netns
    from hpkv.testing.server import ServerProcess
    from hpkv.testing.vllm_server import hpkv_status

    n, bpt = results["requests"], results["kv_bytes_per_token"]
    segment = int(prompt_bytes * (n + 2) * 1.5) + (256 << 20)
    with netns.namespaces(2, veth=True) as (a, b), mc.master(a, Path(work)) as m:
        nodes: list[Any] = []
        try:
            for ns, tag, seg in ((a, "a", segment), (b, "b", 0)):
                e = dict(env)
                e.update(
                    HPKV_SHARE_MEM_FILE_PATH=f"{env['HPKV_SHARE_MEM_FILE_PATH']}-node-{tag}",
                    HPKV_KV_STORAGE_PATH="",  # DRAM + remote: node B's hit comes from the store
                    **mc.node_keys(m, ns.addr, str(seg)),
                )
                e.pop("HPKV_SERVER_IDLE_EXIT", None)
                e["HPKV_CONFIG_FILE_PATH"] = os.path.join(work, f"config-node-{tag}.ini")  # removed with it
                with open(e["HPKV_CONFIG_FILE_PATH"], "w") as f:
                    f.write("# hpkv bench ttft --remote: a node's private pool, no storage\n")
                # each node's operator runs `hpkv serve`: it outlives the node's engine
                nodes.append((ns, e, ServerProcess(e, prefix=ns.argv([]))))
            ns_a, env_a, hpkv_a = nodes[0]
            hpkv_a.start()
            srv = start_vllm(engine[0], env_a, "node-a", True, True, *engine[1:], work, ns_a)
            warm_up(srv, args.tokens)
            try:
                phase(
                    "remote_cold", srv, node_env=env_a, meter=CpuMeter(env_a["HPKV_SHARE_MEM_FILE_PATH"], n)
                )
                want = sum(ns.get("commits", 0) for ns in (hpkv_status(env_a) or {}).get("namespaces", []))
                results["remote_published_wait_s"] = round(_wait_published(env_a, want), 2)
                results.update({k: v for k, v in (hpkv_key_shape(env_a) or {}).items() if k not in results})
            finally:
                srv.stop()
            ns_b, env_b, hpkv_b = nodes[1]
            hpkv_b.start()
            srv = start_vllm(engine[0], env_b, "node-b", True, True, *engine[1:], work, ns_b)
            warm_up(srv, args.tokens)
            try:
                phase(
                    "remote_hit",
                    srv,
                    repeat=True,
                    node_env=env_b,
                    meter=CpuMeter(env_b["HPKV_SHARE_MEM_FILE_PATH"], n),
                )
            finally:
                srv.stop()
            results["remote_counters"] = (hpkv_status(env_b) or {}).get("storage", {}).get("remote")
            shard = round((results.get("block_tokens") or 16) * results.get("loaded_bytes_per_token", bpt))
            obj = file_size(shard)  # an object is a block's KV file image: header page + payload
            count = max(1, -(-prompt_bytes // shard))
            _log(f"floor: raw batch_get_into of {count} objects of {obj} bytes from node B")
            results["remote_floor_gbps"] = raw_get_gbps(ns_b, m, obj, count)
            # vLLM's EngineCore and its worker spin on sched_yield while they wait for each other
            # (a load in the background included): the same floor beside one such spinner
            _log("floor: the same beside a process spinning on sched_yield, as a waiting engine does")
            results["remote_floor_spin_gbps"] = raw_get_gbps(ns_b, m, obj, count, spinners=1)
        finally:
            for _, _, proc in reversed(nodes):
                proc.cleanup()


def memcpy_thread_counts(cpus: int) -> tuple[int, ...]:
    """Thread counts the memcpy floor is measured at: 1, 2, 4, ... up to ``cpus`` (at most 8)."""
    out, t = [], 1
    while t <= min(cpus, 8):
        out.append(t)
        t *= 2
    return tuple(out)


def engine_cpus_during_load(res: dict[str, Any], hit: str, added_s: float) -> float | None:
    """How many CPUs the engine kept busy during the time a hit phase adds to the GPU hit: its
    CPU seconds per request beyond the GPU hit's, per second added. The GPU hit is the same
    prompt sent again right after (``<hit>_repeat``, as :func:`added_ms` pairs them) where the
    phase sent repeats, else the GPU-hit phase. vLLM's EngineCore polls its worker
    (``sched_yield``) while the worker waits for hpkv's copy."""
    cpu = res.get("cpu_s_per_request", {})
    gpu = cpu.get(f"{hit}_repeat") or cpu.get("gpu_hit", {})
    hit_cpu, gpu_cpu = cpu.get(hit, {}).get("engine"), gpu.get("engine")
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


def rate_on_cpus(by_threads: dict[int, float], cpus: float) -> float | None:
    """The memcpy rate on ``cpus`` CPUs (a fraction where an engine keeps part of one busy):
    interpolated linearly between the thread counts measured, the best of them measured at or
    below ``cpus`` beyond the last; None when nothing was measured."""
    points = sorted(by_threads.items())
    if not points:
        return None
    below = [(t, v) for t, v in points if t <= cpus]
    above = [(t, v) for t, v in points if t > cpus]
    if not below:
        return points[0][1]
    (t0, v0), best = below[-1], max(v for _, v in below)
    if not above:
        return best
    t1, v1 = above[0]
    return max(best, v0 + (v1 - v0) * (cpus - t0) / (t1 - t0))


def _floor_columns(out: dict[str, Any], res: dict[str, Any], tier: str, hit: str) -> None:
    """``<tier>_added_ms`` (:func:`added_ms`), ``<tier>_floor_ms`` (the bytes it loaded per
    request at the floor's rate) and their ratio.

    The DRAM floor is the best memcpy on the CPUs the engine leaves free while hpkv copies
    (at least one): the issue's definition. The engine keeps a fraction of a CPU busy (its
    polling), so the CPUs left are a fraction too, and the floor's rate is interpolated
    between the thread counts measured (:func:`rate_on_cpus`) rather than rounded to a
    whole CPU, which moved the floor by 2x for 0.1 CPU either side of a half. Beside it,
    ``dram_floor_all_cpus_ms`` and its ratio: the same bytes at the best memcpy on every
    CPU, as if the engine used none."""
    rates = res.get(f"{tier}_floor_gbps") or {}
    best = rates.get("best")
    tokens = res.get("served_tokens", {}).get(hit, {}).get(tier, 0)
    added = added_ms(res["ttft"], hit)
    if added is None or not best or not tokens:
        return
    nbytes = tokens / res["requests"] * res.get("loaded_bytes_per_token", res["kv_bytes_per_token"])
    gbps = best
    if tier == "dram":
        busy = engine_cpus_during_load(res, hit, added / 1000)
        cpus = int(res.get("cpus") or 0)
        if busy is not None and cpus:
            free = min(float(cpus), max(1.0, cpus - busy))
            measured = {int(k[len("threads_") :]): v for k, v in rates.items() if k.startswith("threads_")}
            gbps = rate_on_cpus(measured, free) or best
            all_cpus = nbytes / (best * 1e9) * 1000
            out.update(
                {
                    "dram_engine_cpus_during_load": round(busy, 2),
                    "dram_floor_cpus": round(free, 2),
                    "dram_floor_all_cpus_ms": round(all_cpus, 1),
                    "dram_added_vs_floor_all_cpus": round(added / all_cpus, 3),
                }
            )
    spin = (res.get(f"{tier}_floor_spin_gbps") or {}).get("best")
    if spin:  # the remote floor beside a process spinning as a waiting engine does
        spin_ms = nbytes / (spin * 1e9) * 1000
        out.update(
            {
                f"{tier}_floor_spin_gbps": res[f"{tier}_floor_spin_gbps"],
                f"{tier}_floor_spin_ms": round(spin_ms, 1),
                f"{tier}_added_vs_floor_spin": round(added / spin_ms, 3),
            }
        )
    floor = nbytes / (gbps * 1e9) * 1000
    if tier == "remote":
        out.update(_machine_cpu(res, hit, nbytes, floor))
    out.update(
        {
            f"{tier}_bytes_per_request": int(nbytes),
            f"{tier}_added_ms": round(added, 1),
            f"{tier}_floor_ms": round(floor, 1),
            f"{tier}_added_vs_floor": round(added / floor, 3),  # 3 places: 1.303 is not met
            f"{tier}_floor_gbps": rates,
        }
    )


def _machine_cpu(res: dict[str, Any], hit: str, nbytes: float, floor_ms: float) -> dict[str, Any]:
    """Whether the machine's CPUs bound a remote hit: the CPU seconds the whole machine spent
    on the raw floor's gets of ``nbytes`` (both nodes and the kernel's network work) and on a
    hit beyond its GPU hit (the repeat right after), by whom, and the least time that CPU work
    takes on this machine's CPUs. Where that is above the floor's time times the target, no
    overlap can meet the target here: the work, not waiting, sets the time."""
    fl = res.get("remote_floor_gbps") or {}
    rounds, span = fl.get("machine_cpu_s"), fl.get("bytes")
    cpu = res.get("cpu_s_per_request", {})
    hit_cpu, gpu_cpu = cpu.get(hit, {}), cpu.get(f"{hit}_repeat", {})
    cpus = int(res.get("cpus") or 0)
    if not rounds or not span or "machine" not in hit_cpu or "machine" not in gpu_cpu or not cpus:
        return {}
    floor_cpu = statistics.median(rounds) * nbytes / span
    busy = statistics.median(c / (span / (r * 1e9)) for c, r in zip(rounds, fl["rounds"], strict=True))
    added = {k: max(0.0, hit_cpu[k] - gpu_cpu.get(k, 0.0)) for k in ("machine", "engine", "hpkv")}
    least_ms = added["machine"] / cpus * 1000
    return {
        "remote_floor_machine_cpu_s": round(floor_cpu, 4),
        "remote_floor_cpus_busy": round(busy, 2),
        "remote_added_machine_cpu_s": {k: round(v, 4) for k, v in added.items()},
        "remote_cpu_bound_ms": round(least_ms, 1),
        "remote_cpu_bound_vs_floor": round(least_ms / floor_ms, 3),
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t = res["ttft"]
    out: dict[str, Any] = {f"{p}_s": round(statistics.mean(t[p]), 4) for p in PHASES if p in t}
    for hit in ("dram_hit", "storage_hit", "remote_hit"):
        if t.get(f"{hit}_repeat"):
            out[f"{hit}_repeat_s"] = round(statistics.mean(t[f"{hit}_repeat"]), 4)
    served = res.get("served_tokens", {})
    out["dram_loaded_tokens"] = served.get("dram_hit", {}).get("dram", 0)
    out["storage_loaded_tokens"] = served.get("storage_hit", {}).get("storage", 0)
    if "remote_hit" in served:
        out["remote_loaded_tokens"] = served["remote_hit"].get("remote", 0)
    ratio = cold_vs_baseline(t, bool(res.get("cold_paired")))
    if ratio is not None:
        out["cold_vs_baseline"] = round(ratio, 3)
    if res.get("cold_save_ms") is not None and t.get("cold"):
        out["cold_save_ms"] = res["cold_save_ms"]
        out["cold_save_share"] = round(res["cold_save_ms"] / 1000 / statistics.median(t["cold"]), 4)
    cold_cpu = res.get("cpu_s_per_request", {}).get("cold", {})
    if cold_cpu.get("engine"):
        # hpkv's CPU for a cold request and its write-through, against the engine's prefill
        out["cold_hpkv_cpu_vs_engine"] = round(cold_cpu["hpkv"] / cold_cpu["engine"], 3)
    if "kv_bytes_per_token" in res:
        _floor_columns(out, res, "dram", "dram_hit")
        _floor_columns(out, res, "storage", "storage_hit")
        _floor_columns(out, res, "remote", "remote_hit")
    for k in (
        "shape",
        "kv_bytes_per_token",
        "loaded_bytes_per_token",
        "block_tokens",
        "pool_bytes",
        "cpus",
        "baseline",
        "write_through_wait_s",
        "cold_paired",
        "cpu_s_per_request",
        "interference",
        "engine",
        "remote_published_wait_s",
        "remote_counters",
        "remote_skipped",
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
        "remote_cold": "node A: cold prefill (publishes)",
        "remote_hit": "node B: remote hit (Mooncake)",
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
    for tier, hit in (("dram", "DRAM hit"), ("storage", "storage hit"), ("remote", "remote hit")):
        if f"{tier}_added_ms" in s:
            fl = s[f"{tier}_floor_gbps"]
            rates = _floor_rates(tier, fl)
            where = ""
            if tier == "dram" and "dram_floor_cpus" in s:
                where = (
                    f" on the {s['dram_floor_cpus']:g} of {s['cpus']} CPU(s) the engine leaves free (it kept "
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
                f"({rates} GB/s) -> {s[f'{tier}_added_vs_floor']:.3f}x the floor "
                f"(target <= 1.3x: {'met' if s[f'{tier}_added_vs_floor'] <= 1.3 else 'NOT met'})"
            )
            _print_other_floors(s, tier)
    _print_remote_skipped(s)
    _print_hybrid_bytes(s)
    for label, key in (
        ("during a storage hit", "during_storage_hit"),
        ("during a DRAM hit loaded in the step", "during_dram_hit_in_step"),
        ("during a DRAM hit (HPKV_ASYNC_DRAM_LOADS)", "during_dram_hit_configured"),
        ("during a GPU prefix-cache hit (no load: the floor)", "during_gpu_hit"),
        ("during a write-through", "during_write_through"),
    ):
        inter = s.get("interference", {})
        if "max_ms" in inter.get(key, {}):
            a, d = inter["alone"], inter[key]
            print(
                f"  streaming client {label}: gaps p50 {d['p50_ms']:.0f} ms, max {d['max_ms']:.0f} ms; alone "
                f"p50 {a['p50_ms']:.0f} ms, max {a['max_ms']:.0f} ms -> max {d['max_vs_alone_max']:.2f}x "
                f"(target <= 1.5x: {'met' if d['max_vs_alone_max'] <= 1.5 else 'NOT met'}; "
                f"{d['gaps']} gaps in {_seconds(d['window_s'])} s"
                + (
                    f", {d['spills_left_at_first_byte']} spills left at the cold prompt's first byte)"
                    if "spills_left_at_first_byte" in d
                    else ")"
                )
            )
            hit_ttft = inter.get(key.replace("during_", "") + "_ttft_s")
            if isinstance(hit_ttft, list):
                print(f"    the hit's own TTFT: {_seconds(hit_ttft)} s (each round)")
        elif key in inter:
            print(f"  streaming client {label}: {inter[key].get('skipped')}")
    alone = s.get("interference", {}).get("dram_hit_alone_ttft_s")
    if alone:
        print(
            "  a DRAM hit with no other request, TTFT: loaded in the step "
            f"{_seconds(alone['in_step'])} s; in the background {_seconds(alone['background'])} s"
        )
    _print_cold(s)


def _print_other_floors(s: dict[str, Any], tier: str) -> None:
    """The DRAM floor on every CPU; the remote floor beside a spinning engine."""
    if f"{tier}_floor_spin_ms" in s:
        print(
            f"    the same raw gets beside one process spinning on sched_yield (as vLLM's EngineCore "
            f"and worker do while they wait for each other): floor {s[f'{tier}_floor_spin_ms']:.1f} ms "
            f"({_floor_rates(tier, s[f'{tier}_floor_spin_gbps'])} GB/s) -> "
            f"{s[f'{tier}_added_vs_floor_spin']:.3f}x"
        )
    if tier == "remote" and "remote_cpu_bound_ms" in s:
        a = s["remote_added_machine_cpu_s"]
        print(
            f"    the machine's CPU: the raw gets of these bytes took {s['remote_floor_machine_cpu_s']:.3f} "
            f"CPU-s ({s['remote_floor_cpus_busy']:.2f} of {s['cpus']} CPUs busy while they ran); "
            f"a remote hit added {a['machine']:.3f} CPU-s to its GPU hit (vLLM {a['engine']:.3f}, this "
            f"node's hpkv {a['hpkv']:.3f}, the rest {max(0.0, a['machine'] - a['engine'] - a['hpkv']):.3f}: "
            f"the other node, the kernel's network work), at least {s['remote_cpu_bound_ms']:.1f} ms on "
            f"{s['cpus']} CPUs -> {s['remote_cpu_bound_vs_floor']:.3f}x the floor by CPU work alone"
        )
    if tier == "dram" and "dram_floor_all_cpus_ms" in s:
        print(
            f"    against all {s['cpus']} CPUs, as if the engine used none: floor "
            f"{s['dram_floor_all_cpus_ms']:.1f} ms -> {s['dram_added_vs_floor_all_cpus']:.3f}x"
        )


def _floor_rates(tier: str, floor: dict[str, Any]) -> str:
    """A floor's rates for the table: per thread count, or the remote floor's rounds."""
    if tier == "remote":  # the raw batch_get_into of as many bytes, from node B
        return f"raw batch_get_into, best of {', '.join(f'{v:g}' for v in floor['rounds'])}"
    return ", ".join(f"{k} {v:g}" for k, v in floor.items() if k.startswith("threads_"))


def _print_remote_skipped(s: dict[str, Any]) -> None:
    if "remote_skipped" in s:
        print(f"  remote phases skipped: {s['remote_skipped']}")


def _seconds(value: float | list[float]) -> str:
    """A duration, or each round's, for the table."""
    return ", ".join(f"{v:g}" for v in value) if isinstance(value, list) else f"{value:g}"


def _print_hybrid_bytes(s: dict[str, Any]) -> None:
    """A hybrid model's hit loads each KV cache group what it needs (a sliding window only its
    last blocks): its bytes per hit against a full-attention model of the same shape."""
    per_token, block = s.get("loaded_bytes_per_token"), s.get("block_tokens")
    if not per_token or not block or per_token >= s["kv_bytes_per_token"]:
        return
    hit_tokens = (s["tokens"] + 1) // block * block  # the prompt's full blocks
    full = hit_tokens * s["kv_bytes_per_token"]
    for tier, hit in (("dram", "dram_hit"), ("storage", "storage_hit")):
        tokens = s["served_tokens"].get(hit, {}).get(tier, 0)
        if tokens:
            nbytes = tokens / s["requests"] * per_token
            print(
                f"  {tier} hit of {hit_tokens} tokens loaded {nbytes / 2**20:.1f} MiB; every layer's KV "
                f"(a full-attention model of this shape) would be {full / 2**20:.1f} MiB: {nbytes / full:.3f}x"
            )


def _print_cold(s: dict[str, Any]) -> None:
    if "cold_vs_baseline" in s:
        ok = "met" if s["cold_vs_baseline"] <= 1.03 else "NOT met"
        how = "paired prompts, both orders alike" if s.get("cold_paired") else "ratio of the means"
        if s.get("requests") == 1:  # one pair, one order: says nothing about a 3% target
            how = (
                "one pair; two cold prefills of a prompt can differ by tens of % on a shared "
                "machine: --requests 3 or more"
            )
        print(f"  cold with hpkv / baseline: {s['cold_vs_baseline']:.3f}, {how} (target <= 1.03: {ok})")
    if "cold_save_ms" in s:
        print(
            f"  hpkv's save copies, beside the engine's next step: {s['cold_save_ms']:.1f} ms per cold "
            f"request ({100 * s['cold_save_share']:.2f}% of its TTFT)"
        )
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
    args.remote = getattr(args, "remote", False) or getattr(args, "remote_only", False)
    res = run_url(args) if args.url else run_orchestrated(args)
    s = summarize(res)
    if args.json:
        print(json.dumps(s))
    else:
        print_table(s)
        if res.get("top_frame"):
            print("\nhpkv-top --once, after the storage phase:\n" + res["top_frame"])
    return 0
