"""The remote tier under real vLLM: a prompt one node computed is a remote hit on another node.

A Mooncake master and two hpkv "nodes", each in a network namespace of its own joined by a
veth (as in test_remote_mooncake.py): every node runs its own hpkv server (its own pool and
runtime directory, no storage directory: DRAM + remote) started by the operator with ``hpkv
serve``, so it outlives the engines, and vLLM inside the same namespace, bound to its
loopback. vLLM on node A computes a prompt (A's hpkv publishes the blocks to the store, held
in A's segment) and is stopped with Ctrl-C; vLLM on node B, whose hpkv holds nothing, gets the
same prompt: B's hpkv finds the blocks in the store and loads them (remote-tier loads in its
namespace counters, ``loaded`` in B's remote counters), and B's output and logprobs are those of
A's run. One engine at a time (the CPU). Needs root (network namespaces) and Mooncake; skips
saying why otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_vllm_connector import (
    BLOCK,
    HIT_TOKENS,
    MODULE_PATH_FORM,
    THRESHOLD,
    assert_same_up_to_noise,
    complete_with,
    delta,
    letters,
    vllm_args,
)

from hpkv.io_workers import mooncake_api
from hpkv.testing import mooncake as mc
from hpkv.testing import netns
from hpkv.testing.server import ServerProcess, private_env
from hpkv.testing.vllm_server import VllmServer, hpkv_loads, hpkv_status

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = letters(200, seed=41)  # 6 full blocks and a partial one (never stored)
BLOCKS = HIT_TOKENS // BLOCK


def node_env(ns: netns.Netns, m: mc.Master, segment: str) -> dict[str, str]:
    """A node's hpkv settings: its own pool and runtime directory, the remote tier, no files."""
    return private_env(
        pool_size="256m",
        storage="",
        VLLM_HPKV_TOKEN_THRESHOLD=str(THRESHOLD),
        HPKV_LOG_LEVEL="INFO",
        **mc.node_keys(m, ns.addr, segment),
    )


def remote(env: dict[str, str]) -> dict:
    status = hpkv_status(env)
    assert status is not None, "the node's hpkv server is not running"
    return status["storage"]["remote"]


def wait_remote(env: dict[str, str], cond, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not cond(r := remote(env)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {r}"
        time.sleep(0.2)
    return r


def by_id(srv: VllmServer, **body: object) -> tuple[str, list]:
    """The greedy completion of PROMPT with its top logprobs keyed by token id (complete_with's
    default)."""
    return complete_with(srv, PROMPT, **body)


def engine(model: str, env: dict[str, str], ns: netns.Netns, log: Path) -> VllmServer:
    return VllmServer(
        model,
        extra_args=vllm_args(MODULE_PATH_FORM),
        env=env,
        dev_mode=True,
        max_model_len=4096,
        netns=ns,
        log_path=log,
    )


def test_a_prompt_vllm_computed_on_node_a_is_a_remote_hit_for_vllm_on_node_b(tiny_model, tmp_path):
    why = netns.unavailable() or mooncake_api.unavailable()
    if why:
        pytest.skip(why)
    with netns.namespaces(2, veth=True) as (a, b), mc.master(a, tmp_path) as m:
        env_a = node_env(a, m, segment="256m")  # A lends the store the memory its objects live in
        env_b = node_env(b, m, segment="0")  # B is a pure client
        servers: list[ServerProcess] = []
        try:
            # Each node's operator runs `hpkv serve`: the server (and the Mooncake segment it
            # holds) outlives the node's engine, as a node's store must.
            servers.append(ServerProcess(env_a, prefix=a.argv([])).start())
            va = engine(tiny_model, env_a, a, tmp_path / "vllm-a.log")
            try:
                va.start().wait_ready()
                cold_text, cold_lp = by_id(va)  # computed; A's hpkv saves 6 blocks
                gpu_text, gpu_lp = by_id(va)  # A's prefix cache: the KV of a hit
                # (a hit's tail is computed over stored KV, a cold prefill in one pass: the tiny
                # model's near ties may flip between the two, so cold is compared up to noise)
                wait_remote(env_a, lambda r: r["published"] >= BLOCKS, f"{BLOCKS} blocks published by A")
            finally:
                va.interrupt()  # Ctrl-C in A's terminal
                va.stop()
            assert servers[0].proc is not None and servers[0].proc.poll() is None, "A's hpkv server stopped"

            servers.append(ServerProcess(env_b, prefix=b.argv([])).start())
            assert remote(env_b)["loaded"] == 0
            vb = engine(tiny_model, env_b, b, tmp_path / "vllm-b.log")
            try:
                vb.start().wait_ready()
                before = hpkv_loads(env_b, remote=True)
                text_b, lp_b = by_id(vb)
                assert delta(before, hpkv_loads(env_b, remote=True)) == {
                    "dram": 0,
                    "storage": 0,
                    "remote": HIT_TOKENS,
                }, f"not a remote hit on B: {remote(env_b)}\n{servers[1].log()[-3000:]}"
                r = wait_remote(
                    env_b, lambda r: r["loaded"] == BLOCKS, "B's counters (published every 0.2 s)"
                )
                assert r["found"] >= BLOCKS and r["corrupt"] == 0 and r["errors"] == 0, r
                # B's own recompute, for the same prompt (hpkv skipped: neither loaded nor saved)
                vb.post("/reset_prefix_cache")
                text_r, lp_r = by_id(vb, kv_transfer_params={"hpkv_skip": True})
            finally:
                vb.stop()
            assert text_b == gpu_text and lp_b == gpu_lp, "A's KV bytes, the same computation: identical"
            assert_same_up_to_noise([(text_b, lp_b)], [(cold_text, cold_lp)])
            assert_same_up_to_noise([(text_b, lp_b)], [(text_r, lp_r)])
        finally:
            for s in reversed(servers):
                s.cleanup()
