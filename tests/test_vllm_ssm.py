"""An SSM/linear-attention hybrid through hpkv: real vLLM on the CPU with a generated
Qwen3-Next-style model (4 layers: 3 gated delta net, 1 full attention), prefix caching on in
vLLM's ``mamba_cache_mode="align"``, real hpkv processes.

vLLM keeps 4 KV cache groups of one layer each (it groups 3:1 layers one by one): the attention
layer's (full attention) and one per linear-attention layer, whose block holds its recurrent
state (conv + SSM state, padded to the attention page; vLLM sets the block size to 384 tokens
for the pages to match). A hit of ``n`` blocks loads every attention block and from each state
group the one block holding the state after ``n`` blocks; hpkv saves the states vLLM hands
over (those it keeps for its own prefix cache). One vLLM server for the module (a start
costs 60-200 s here).
"""

from __future__ import annotations

import json

import pytest
from test_vllm_connector import (
    assert_same_up_to_noise,
    complete,
    complete_with,
    delta,
    kv_files,
    letters,
    loaded,
    reset,
    restart_engine_and_hpkv,
    wait_for_files,
)
from test_vllm_hybrid import KTC, SSM_CAPACITY_WITHOUT_HPKV, committed, kv_cache_size

from hpkv.testing.model import generate_model
from hpkv.testing.server import engine_env
from hpkv.testing.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 384  # vLLM's attention block size for this model (the state page's size)
STATE_GROUPS = 3
MAX_MODEL_LEN = 4096
ALIGN = ["--enable-prefix-caching", "--mamba-cache-mode", "align"]


@pytest.fixture(scope="module")
def hpkv_env():
    with engine_env(
        "ssm",
        pool_size="512m",
        VLLM_HPKV_TOKEN_THRESHOLD="64",
        HPKV_SERVER_IDLE_EXIT="30",
        HPKV_LOG_LEVEL="INFO",
    ) as env:
        yield env


@pytest.fixture(scope="module")
def server(hpkv_env):
    model = generate_model(kind="qwen3_next", num_layers=4, full_attention_every=4)
    args = ["--kv-transfer-config", json.dumps(KTC), *ALIGN, "--max-num-seqs", "4"]
    srv = VllmServer(model, extra_args=args, env=hpkv_env, dev_mode=True, max_model_len=MAX_MODEL_LEN)
    srv.start().wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


def test_vllm_keeps_its_hybrid_kv_cache_manager_and_its_capacity(server):
    log = server.log_tail(100_000)
    assert "Turning off hybrid kv cache manager" not in log
    assert "hpkv disabled" not in log
    # vLLM's capacity for this model without any connector, in align mode too (measured
    # 2026-12-05: "kv_cache_size_tokens=2631559" with --enable-prefix-caching --mamba-cache-mode align)
    assert kv_cache_size(log) == SSM_CAPACITY_WITHOUT_HPKV


def test_gpu_dram_and_storage_hits_restore_the_state_and_give_the_cold_runs_output(server, hpkv_env):
    blocks = 2
    prompt = letters(blocks * BLOCK + 8, seed=500)  # the last, partial block is recomputed
    files, commits = kv_files(hpkv_env), committed(hpkv_env)
    cold_text, cold_lp = complete(server, prompt)  # recompute; hpkv saves the KV and the state
    # vLLM's align mode ends the first prefill chunk at 2 blocks and hands its states over:
    # every attention block and each state group's one block are stored (no state after 1
    # block exists: no chunk ended there)
    stored = blocks + STATE_GROUPS
    assert committed(hpkv_env) - commits == stored
    gpu_text, gpu_lp = complete(server, prompt)  # vLLM's own prefix cache
    assert gpu_text == cold_text
    # the 8 tokens computed after a cached prefix are not the cold prefill's computation
    # (bf16 rounding differs): the cold run's logprobs agree within noise, every hit below
    # is the GPU hit's computation and must be identical to it
    assert_same_up_to_noise([(gpu_text, gpu_lp)], [(cold_text, cold_lp)])

    reset(server)  # vLLM's cache only: hpkv keeps DRAM
    before = loaded(hpkv_env)
    dram_text, dram_lp = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": stored * BLOCK, "storage": 0}
    assert dram_text == cold_text
    assert dram_lp == gpu_lp, "same KV and state bytes, same computation: logprobs must be identical"

    wait_for_files(hpkv_env, files + stored)
    assert kv_files(hpkv_env) == files + stored, "on disk too"
    reset(server, external=True)  # drops hpkv's DRAM tier; files stay
    before = loaded(hpkv_env)
    storage_text, storage_lp = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": stored * BLOCK}
    assert storage_text == cold_text
    assert storage_lp == gpu_lp


def test_the_next_turn_of_a_conversation_hits_the_whole_previous_prompt(server, hpkv_env):
    """A prompt of 3 blocks and 8 tokens, then one that extends it: the second loads the
    first's 3 attention blocks and the states after them, and computes the rest."""
    first = letters(3 * BLOCK + 8, seed=600)
    second = first + " " + letters(BLOCK, seed=601)
    reset(server)
    cold_text, cold_lp = complete_with(server, second, kv_transfer_params={"hpkv_skip": True})
    reset(server)
    commits = committed(hpkv_env)
    complete(server, first)
    assert committed(hpkv_env) - commits == 3 + STATE_GROUPS
    reset(server)
    before = loaded(hpkv_env)
    hit_text, hit_lp = complete(server, second)
    assert delta(before, loaded(hpkv_env)) == {"dram": (3 + STATE_GROUPS) * BLOCK, "storage": 0}
    assert hit_text == cold_text
    # the blocks after the loaded prefix are computed from the loaded state, not in the cold
    # prefill's one pass: bf16 rounding differs, the logprobs agree within noise
    assert_same_up_to_noise([(hit_text, hit_lp)], [(cold_text, cold_lp)])


def test_a_storage_hit_after_restarting_vllm_and_hpkv_restores_the_state(server, hpkv_env):
    """The attention blocks and the states from the files alone, after vLLM and hpkv were
    stopped and started again: the GPU hit's output and logprobs."""
    blocks = 2
    prompt = letters(blocks * BLOCK + 8, seed=700)
    files = kv_files(hpkv_env)
    complete(server, prompt)  # cold: hpkv saves the KV and the states
    gpu = complete(server, prompt)  # vLLM's own prefix cache
    stored = blocks + STATE_GROUPS
    wait_for_files(hpkv_env, files + stored)
    restart_engine_and_hpkv(server, hpkv_env)
    before = loaded(hpkv_env)
    got = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": stored * BLOCK}
    assert got == gpu, "same KV and state bytes, same computation, a new engine: identical logprobs"
