"""hpkv as SGLang HiCache's storage tier, end to end: real SGLang 0.5.23 on the CPU (``.venv-sglang``),
the generated tiny model, real hpkv processes, CT-HPKV's ``--enable-ct-hpkv``.

One SGLang server is shared by the tests of this module, in file order (the first restarts it
with hpkv, a later one kills hpkv under it, the last adds a vLLM server on the same hpkv
server). Pages are 16 tokens and the threshold 64 tokens, so every tier is exercised with
short prompts. SGLang's ``cached_tokens_details`` says which
of its tiers served the prefix (``storage`` = L3 = hpkv); hpkv's counters (``hpkv status
--json``) say which of hpkv's tiers (DRAM pool or KV files) served it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from hpkv.testing.server import engine_env
from hpkv.testing.sglang_server import SglangServer, cached_tokens, hpkv_backend_args, sglang_python
from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, hpkv_loads, hpkv_status

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(sglang_python() is None, reason="no .venv-sglang (scripts/setup-sglang.sh)"),
]

PAGE = 16
THRESHOLD = 64


def letters(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n))


@pytest.fixture(scope="module")
def hpkv_env() -> Iterator[dict[str, str]]:
    with engine_env(
        "sglang",
        pool_size="256m",
        VLLM_HPKV_TOKEN_THRESHOLD=str(THRESHOLD),
        HPKV_SERVER_IDLE_EXIT="60",
        HPKV_LOG_LEVEL="INFO",
        HPKV_PROMOTE_PART_SIZE="128k",  # storage hits promote in parts of 2 pages of the tiny model
        # lookups answered before a stat can return: after the restart the files are found by
        # asking again (batch_exists, HPKV_STORAGE_LOOKUP_RETRY_MS), not in the first answer
        HPKV_STORAGE_LOOKUP_WAIT_MS="0",
    ) as env:
        yield env


@pytest.fixture(scope="module")
def server(
    tiny_model: str, hpkv_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangServer]:
    log = tmp_path_factory.mktemp("sglang-logs") / "sglang.log"
    # wait_complete: a loaded machine must not turn an L3 hit into a partial one (the default
    # policy gives up after ~1 s); the tests count exactly which tier served how much.
    args = [*hpkv_backend_args(), "--hicache-storage-prefetch-policy", "wait_complete"]
    srv = SglangServer(tiny_model, extra_args=args, env=hpkv_env, page_size=PAGE, log_path=log)
    try:
        srv.start().wait_ready()
        yield srv
    except BaseException:
        print(srv.log_tail(120))
        raise
    finally:
        srv.stop()


def generate(srv: SglangServer, prompt: str) -> tuple[str, list[float], dict[str, int]]:
    out = srv.generate(prompt, max_new_tokens=16)
    lps = [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]
    return out["text"], lps, cached_tokens(out)


def assert_same(
    got: tuple[str, list[float], Any], expected: tuple[str, list[float], Any], tol: float = 0.02
) -> None:
    """Same greedy text; the chosen tokens' logprobs agree up to prefill-shape rounding."""
    assert got[0] == expected[0]
    assert len(got[1]) == len(expected[1])
    for i, (a, b) in enumerate(zip(got[1], expected[1], strict=True)):
        assert abs(a - b) <= tol, (i, a, b)


def sglang_namespace(env: dict[str, str]) -> dict[str, Any]:
    st = hpkv_status(env)
    assert st is not None, "no hpkv server is running"
    rows = [ns for ns in st["namespaces"] if f"ps{PAGE}" in ns.get("name", "")]
    assert len(rows) == 1, st["namespaces"]
    return rows[0]


def wait_stored(env: dict[str, str], pages: int, timeout: float = 60.0) -> None:
    """SGLang backs pages up to L3 on its own thread after the request: wait for hpkv's commits."""
    deadline = time.monotonic() + timeout
    while (have := sglang_namespace(env).get("commits", 0)) < pages:
        assert time.monotonic() < deadline, f"only {have} of {pages} pages stored after {timeout:g} s"
        time.sleep(0.2)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


PROMPT = letters(200, seed=1)  # 12 full pages and a partial one


def test_every_tier_gives_the_same_greedy_output_and_logprobs(
    server: SglangServer, hpkv_env: dict[str, str]
) -> None:
    cold = generate(server, PROMPT)  # recompute; written through to hpkv
    assert cold[2]["total"] == 0
    wait_stored(hpkv_env, 12)
    gpu = generate(server, PROMPT)  # SGLang's own (device) cache
    assert gpu[2]["device"] >= 12 * PAGE and gpu[2]["storage"] == 0
    assert_same(gpu, cold)

    server.flush_cache()  # L1 + L2 gone, hpkv keeps its tiers
    before = hpkv_loads(hpkv_env)
    dram = generate(server, PROMPT)
    assert dram[2]["storage"] >= 12 * PAGE, dram[2]
    loaded = delta(before, hpkv_loads(hpkv_env))
    assert loaded["storage"] == 0 and loaded["dram"] == dram[2]["storage"], loaded
    assert_same(dram, cold)

    # Both restart: `hpkv stop` writes every pending spill first, the restarted SGLang spawns a
    # new hpkv server, which finds the KV files.
    server.stop()
    stop = subprocess.run(
        [sys.executable, "-m", "hpkv", "stop"], env=hpkv_env, capture_output=True, text=True, timeout=120
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert hpkv_status(hpkv_env) is None
    server.start().wait_ready()
    before = hpkv_loads(hpkv_env)
    disk = generate(server, PROMPT)
    assert disk[2]["storage"] >= 12 * PAGE, disk[2]
    loaded = delta(before, hpkv_loads(hpkv_env))
    assert loaded["dram"] == 0 and loaded["storage"] == disk[2]["storage"], loaded
    assert_same(disk, cold)


def test_hit_below_the_threshold_loads_nothing(server: SglangServer, hpkv_env: dict[str, str]) -> None:
    # Shares PROMPT's first 3 pages (48 tokens < 64), which hpkv has: SGLang asks (its own
    # threshold counts the whole 100-token tail), hpkv answers "no hit", SGLang recomputes.
    mixed = " ".join(PROMPT.split()[:50] + letters(50, seed=2).split())
    server.flush_cache()
    lookups = sglang_namespace(hpkv_env)["lookups"]
    before = hpkv_loads(hpkv_env)
    got = generate(server, mixed)
    assert got[2]["storage"] == 0, got[2]
    assert delta(before, hpkv_loads(hpkv_env)) == {"dram": 0, "storage": 0}
    assert sglang_namespace(hpkv_env)["lookups"] > lookups, "SGLang did not ask hpkv at all"
    assert_same(generate(server, mixed), got)


def test_killed_hpkv_server_means_recompute_not_errors(
    server: SglangServer, hpkv_env: dict[str, str]
) -> None:
    prompt = letters(150, seed=8)
    expected = generate(server, prompt)
    st = hpkv_status(hpkv_env)
    assert st is not None
    os.kill(st["server"]["pid"], signal.SIGKILL)
    for w in st["workers"]:
        try:
            os.kill(w["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    for i in range(3):
        server.flush_cache()
        t0 = time.monotonic()
        got = generate(server, prompt)
        assert_same(got, expected)
        assert time.monotonic() - t0 < 30, "a dead hpkv must not stall SGLang"
        generate(server, letters(80, seed=200 + i))  # new prompts: saves fail quietly
    # SGLang's log says once that hpkv went away and once that it is back (auto-spawned again).
    deadline = time.monotonic() + 90
    for i in range(1000):
        if "the hpkv server is back" in server.log_tail(100_000):
            break
        assert time.monotonic() < deadline, server.log_tail(60)
        generate(server, letters(80, seed=300 + i))
        time.sleep(1.0)
    log = server.log_tail(100_000)
    assert log.count("lost the hpkv server") + log.count("cannot reach the hpkv server") == 1, log[-6000:]
    # And the new server stores and serves again.
    fresh = letters(100, seed=9)  # 6 full pages
    first = generate(server, fresh)
    wait_stored(hpkv_env, 6)
    server.flush_cache()
    before = hpkv_loads(hpkv_env)
    got = generate(server, fresh)
    assert got[2]["storage"] >= 6 * PAGE, got[2]
    assert delta(before, hpkv_loads(hpkv_env))["dram"] == got[2]["storage"]
    assert_same(got, first)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed in this venv")
@pytest.mark.skipif(
    os.environ.get("HPKV_TEST_MIXED_ENGINES") != "1",
    reason="starts a second engine (vLLM, 2-4 min here): set HPKV_TEST_MIXED_ENGINES=1; "
    "left out of CI's 30-minute budget",
)
def test_a_vllm_and_an_sglang_server_share_one_hpkv_server(
    server: SglangServer, hpkv_env: dict[str, str], tiny_model: str, tmp_path: Path
) -> None:
    vllm = VllmServer(
        tiny_model,
        extra_args=[
            "--kv-transfer-config",
            SEED_KV_TRANSFER_CONFIG,
            "--block-size",
            "32",
            "--max-num-seqs",
            "4",
        ],
        env=hpkv_env,
        dev_mode=True,
        max_model_len=4096,
        log_path=tmp_path / "vllm.log",
    )
    try:
        vllm.start().wait_ready()
        # SGLang's host pool (L2) is full after the earlier tests, and SGLang writes a page to L3
        # only through L2: start from empty SGLang caches.
        server.flush_cache()
        prompt = letters(200, seed=11)  # vLLM: 6 blocks of 32; SGLang: 12 pages
        v_first = vllm.completion(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
        stored = sglang_namespace(hpkv_env)["commits"]
        s_first = generate(server, prompt)
        wait_stored(hpkv_env, stored + 12)
        st = hpkv_status(hpkv_env)
        assert st is not None
        names = [ns["name"] for ns in st["namespaces"]]
        assert any(" bs32" in n for n in names) and any(f" ps{PAGE} " in n for n in names), names
        r = requests.post(f"{vllm.url}/reset_prefix_cache", timeout=60)
        assert r.status_code == 200, r.text
        server.flush_cache()
        before = hpkv_loads(hpkv_env)
        v_again = vllm.completion(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
        s_again = generate(server, prompt)
        loaded = delta(before, hpkv_loads(hpkv_env))
        assert s_again[2]["storage"] >= 12 * PAGE, s_again[2]
        assert loaded == {"dram": 6 * 32 + s_again[2]["storage"], "storage": 0}, loaded
        assert v_again == v_first
        assert_same(s_again, s_first)
    except BaseException:
        print(vllm.log_tail(80))
        raise
    finally:
        vllm.stop()
