"""Saves under preemption, end to end: real vLLM on the CPU with a KV cache too small for the
requests it runs at once, so it preempts some and reuses their blocks for others. hpkv's saves
are copied after the step returns (the worker does not wait for them); a preempted request's
saves are finished before its blocks are reused, and a finished request's blocks are freed only
once they are saved. What hpkv saved under that churn must load as the very KV a computation
gives: each prompt alone, loaded from hpkv's DRAM tier, answers exactly as with vLLM's own
prefix cache holding the KV it computed (the same computation: logprobs identical).
"""

from __future__ import annotations

import re

import pytest
from test_vllm_connector import (  # the connector tests' helpers (one vLLM of their own here)
    BLOCK,
    MODULE_PATH_FORM,
    complete_with,
    delta,
    letters,
    loaded,
    reset,
    vllm_args,
)

from hpkv.testing.server import engine_env
from hpkv.testing.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CACHE_BLOCKS = 20  # 640 tokens: four requests of 96 + 128 tokens need 28 blocks at once
SKIP = {"kv_transfer_params": {"hpkv_skip": True}}


def preemptions(srv: VllmServer) -> float:
    m = re.search(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", srv.get("/metrics").text, re.M)
    assert m, "vLLM's metrics have no num_preemptions_total"
    return float(m.group(1))


def test_what_hpkv_saved_while_vllm_preempted_loads_as_the_computed_kv(tiny_model):
    with engine_env("preempt", pool_size="256m", VLLM_HPKV_TOKEN_THRESHOLD="64") as env:
        srv = VllmServer(
            tiny_model,
            extra_args=[*vllm_args(MODULE_PATH_FORM), "--num-gpu-blocks-override", str(CACHE_BLOCKS)],
            env=env,
            dev_mode=True,
            max_model_len=(CACHE_BLOCKS - 1) * BLOCK,  # one block is vLLM's null block
        )
        srv.start().wait_ready()
        try:
            prompts = [letters(96, seed=500 + i) for i in range(4)]
            before = preemptions(srv)
            out = srv.completion(prompts, max_tokens=128, temperature=0, ignore_eos=True)
            assert len(out["choices"]) == 4
            assert preemptions(srv) > before, "the KV cache was large enough: nothing was preempted"
            for p in prompts:
                reset(srv)
                complete_with(srv, p, **SKIP)  # computed; hpkv neither loads nor saves it
                gpu_hit = complete_with(srv, p, **SKIP)  # vLLM's own cache: a hit's computation
                reset(srv)
                was = loaded(env)
                assert complete_with(srv, p) == gpu_hit, "the KV hpkv saved under preemption differs"
                assert delta(was, loaded(env))["dram"] >= 64, "not loaded from hpkv"
        finally:
            srv.stop()
