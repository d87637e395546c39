"""Hybrid models through SGLang HiCache and hpkv: real SGLang 0.5.23 on the CPU (``.venv-sglang``),
generated tiny models, real hpkv processes, ``--enable-ct-hpkv``.

* GPT-OSS-style (sliding window alternating with full attention): SGLang keeps its sliding-window
  layers in a separate SWA pool, and HiCache's hybrid tree hands their pages to the storage
  backend through interface v2 (``batch_exists_v2``/``batch_get_v2``/``batch_set_v2``, pool
  ``swa``, hit policy ``TRAILING_PAGES``). hpkv keeps them in a namespace of their own.
* Gemma-3-style: SGLang 0.5.23 turns hybrid SWA memory off for Gemma 2/3
  (``arg_groups/model_overrides/gemma2_gemma3.py``), so every layer is in the KV pool and hpkv
  serves it as a dense model.
* Qwen3-Next-style (gated delta net + full attention): SGLang-CPU refuses to start with a page
  size above 1 (see docs/sglang.md, "Hybrid models").

One SGLang server at a time (each test starts and stops its own).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hpkv.testing.model import generate_model
from hpkv.testing.server import engine_env
from hpkv.testing.sglang_server import (
    SglangServer,
    cached_tokens,
    hpkv_backend_args,
    sglang_python,
)
from hpkv.testing.vllm_server import VllmServerError, hpkv_loads, hpkv_status

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(sglang_python() is None, reason="no .venv-sglang (scripts/setup-sglang.sh)"),
]

PAGE = 16
THRESHOLD = 64
WINDOW = 64  # tokens: 4 pages


def letters(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n))


PROMPT = letters(200, seed=11)  # 12 full pages and a partial one, 3 windows


@pytest.fixture
def hpkv_env() -> Iterator[dict[str, str]]:
    with engine_env(
        "sglang",
        pool_size="256m",
        VLLM_HPKV_TOKEN_THRESHOLD=str(THRESHOLD),
        HPKV_SERVER_IDLE_EXIT="30",
        HPKV_LOG_LEVEL="INFO",
    ) as env:
        yield env


def start(model: str, env: dict[str, str], log: Any, *extra: str) -> SglangServer:
    # wait_complete: a loaded machine must not turn the L3 hit into a partial one
    args = [*hpkv_backend_args(), "--hicache-storage-prefetch-policy", "wait_complete", *extra]
    srv = SglangServer(model, extra_args=args, env=env, page_size=PAGE, log_path=log)
    try:
        srv.start().wait_ready()
    except BaseException:
        print(srv.log_tail(120))
        srv.stop()
        raise
    return srv


def generate(srv: SglangServer, prompt: str) -> tuple[str, list[float], dict[str, int]]:
    out = srv.generate(prompt, max_new_tokens=8)
    lps = [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]
    return out["text"], lps, cached_tokens(out)


def assert_same(got: tuple[str, list[float], Any], expected: tuple[str, list[float], Any]) -> None:
    assert got[0] == expected[0]
    assert len(got[1]) == len(expected[1])
    for i, (a, b) in enumerate(zip(got[1], expected[1], strict=True)):
        assert abs(a - b) <= 0.02, (i, a, b)


def namespaces(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """hpkv's namespaces of this SGLang server: ``kv``, and one per sidecar pool (``swa``)."""
    st = hpkv_status(env)
    assert st is not None, "no hpkv server is running"
    out = {}
    for ns in st["namespaces"]:
        name = ns.get("name", "")
        if f"ps{PAGE}" in name:
            out["swa" if name.endswith(" swa") else "kv"] = ns
    return out


def wait_commits(env: dict[str, str], want: dict[str, int], timeout: float = 60.0) -> dict[str, Any]:
    """SGLang backs pages up on its own thread after the request: wait for hpkv's commits."""
    deadline = time.monotonic() + timeout
    while True:
        ns = namespaces(env)
        if all(ns.get(k, {}).get("commits", 0) >= n for k, n in want.items()):
            return ns
        assert time.monotonic() < deadline, f"{want} pages not stored after {timeout:g} s: {ns}"
        time.sleep(0.2)


def test_gpt_oss_sliding_window_pool_is_stored_in_its_own_namespace_and_restored(
    hpkv_env: dict[str, str], tmp_path: Any
) -> None:
    model = generate_model(kind="gpt_oss", num_layers=4, full_attention_every=2, sliding_window=WINDOW)
    # SGLang runs GPT-OSS only with attention backends that have sinks; intel_amx falls back to
    # torch_native on a CPU without AMX, which the test shims give sinks and SWA-pool indexing.
    srv = start(str(model), hpkv_env, tmp_path / "sglang.log", "--attention-backend", "intel_amx")
    try:
        cold = generate(srv, PROMPT)
        assert cold[2]["total"] == 0
        # the KV of every full page; the SWA pool's pages only for the window at a node's end
        stored = wait_commits(hpkv_env, {"kv": 12, "swa": 1})
        swa_pages = stored["swa"]["commits"]
        assert swa_pages < 12, f"the sliding-window pool stores a window, not the prompt: {stored['swa']}"

        srv.flush_cache()  # SGLang's L1 and L2 gone; hpkv keeps both namespaces
        before = hpkv_loads(hpkv_env)
        hit = generate(srv, PROMPT)
        assert hit[2]["storage"] >= 12 * PAGE and hit[2]["device"] == 0, hit[2]
        assert hpkv_loads(hpkv_env)["dram"] > before["dram"]
        assert namespaces(hpkv_env)["swa"].get("loads_dram", 0) >= 1
        assert_same(hit, cold)
        log = srv.log_path.read_text(errors="replace")
        assert "NotImplementedError" not in log and "HiCache storage query failed" not in log

        # Both restart: `hpkv stop` writes every pending spill first; the restarted SGLang
        # spawns a new hpkv server, which finds both namespaces' KV files.
        srv.stop()
        stop = subprocess.run(
            [sys.executable, "-m", "hpkv", "stop"], env=hpkv_env, capture_output=True, text=True, timeout=120
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        srv.start().wait_ready()
        disk = generate(srv, PROMPT)
        assert disk[2]["storage"] >= 12 * PAGE, disk[2]
        ns = namespaces(hpkv_env)
        assert ns["kv"].get("loads_storage", 0) >= 1 and ns["swa"].get("loads_storage", 0) >= 1, ns
        assert_same(disk, cold)
    finally:
        srv.stop()


def test_gemma3_runs_in_sglang_as_a_dense_model_and_hits_hpkv(
    hpkv_env: dict[str, str], tmp_path: Any
) -> None:
    model = generate_model(kind="gemma3", num_layers=6, sliding_window=WINDOW)
    log = tmp_path / "sglang.log"
    srv = start(str(model), hpkv_env, log)
    try:
        text = log.read_text(errors="replace")
        assert "Disable hybrid SWA memory for Gemma3ForCausalLM" in text  # SGLang's choice, pinned
        cold = generate(srv, PROMPT)
        stored = wait_commits(hpkv_env, {"kv": 12})
        assert "swa" not in stored
        srv.flush_cache()
        hit = generate(srv, PROMPT)
        assert hit[2]["storage"] >= 12 * PAGE, hit[2]
        assert_same(hit, cold)
    finally:
        srv.stop()


def test_qwen3_next_is_refused_by_sglang_cpu_with_paged_hicache(
    hpkv_env: dict[str, str], tmp_path: Any
) -> None:
    """SGLang-CPU cannot run an SSM/linear-attention hybrid with HiCache pages above 1 token: its
    mamba radix cache needs ``extra_buffer`` there, which only CUDA/MUSA/NPU/HIP/XPU have (and
    the CPU's gated-delta-net kernels are in the CPU build of sgl_kernel, which is not on PyPI).
    Pinned so that a SGLang that lifts this is noticed (then hpkv's sidecar path serves its
    ``mamba`` pool like the ``swa`` one, untested until then)."""
    model = generate_model(kind="qwen3_next", num_layers=4, full_attention_every=4)
    srv = SglangServer(
        str(model),
        extra_args=[*hpkv_backend_args(), "--json-model-override-args", '{"full_attention_interval": 4}'],
        env=hpkv_env,
        page_size=PAGE,
        log_path=tmp_path / "sglang.log",
        ready_timeout=300,
    )
    try:
        with pytest.raises(VllmServerError, match="exited"):  # SglangServer's start-up errors
            srv.start().wait_ready()
        log = (tmp_path / "sglang.log").read_text(errors="replace")
        assert "extra_buffer requires platform support for Mamba cache state snapshots" in log
    finally:
        srv.stop()
    assert hpkv_status(hpkv_env) is None, "SGLang refused before its storage backend started hpkv"
