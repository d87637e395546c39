"""KV events end to end: real vLLM on the CPU with ``--kv-events-config`` (ZMQ on loopback), hpkv
spawned by it, and a ZMQ subscriber decoding the msgpack batches as a router (llm-d, Dynamo) does.

vLLM's own GPU prefix-cache events say which hashes a prompt's blocks have; hpkv's events
must carry the same hashes, tokens and parents, with medium ``CPU`` once a block is in the
DRAM pool and ``STORAGE`` once its file is written, and ``BlockRemoved`` when the pool (2 MiB:
16 blocks) or the storage capacity (16 files) evicts it. A reset with ``reset_external``
publishes ``AllBlocksCleared`` and then what storage still holds; a storage hit read back into the
pool is published in ``CPU`` again.

vLLM publishes a connector's events only while it steps: the test keeps it stepping with
short requests ("pokes") while it waits.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import requests
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from hpkv.io_workers import kvfile
from hpkv.testing.kv_events import Subscriber
from hpkv.testing.server import engine_env
from hpkv.testing.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
BLOCK_BYTES = 8 * 2 * BLOCK * 2 * 64 * 2  # the tiny model: 8 layers, K and V, 2 KV heads of 64, bf16
POOL_BLOCKS = 16
STORAGE_FILES = 16
PROMPT_BLOCKS = 8


@pytest.fixture(scope="module")
def engine(tiny_model):
    with engine_env(
        "events",
        pool_size=f"{POOL_BLOCKS * BLOCK_BYTES}",
        HPKV_KV_STORAGE_SIZE=str(STORAGE_FILES * kvfile.file_size(BLOCK_BYTES)),
        VLLM_HPKV_TOKEN_THRESHOLD="64",
        HPKV_SERVER_IDLE_EXIT="30",
        HPKV_LOG_LEVEL="INFO",
    ) as env:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sub = Subscriber(lambda payload: decoder.decode(payload).events)
        ktc = {
            "kv_connector": "HpkvConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_module_path": "hpkv.connectors.vllm",
        }
        kec = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint, "topic": "kv"}
        srv = VllmServer(
            tiny_model,
            extra_args=[
                "--kv-transfer-config",
                json.dumps(ktc),
                "--kv-events-config",
                json.dumps(kec),
                "--block-size",
                str(BLOCK),
            ],
            env=env,
            dev_mode=True,  # /reset_prefix_cache
            max_model_len=4096,
        )
        try:
            srv.start().wait_ready()
            yield srv, sub
        finally:
            srv.stop()
            sub.close()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 200) for _ in range(PROMPT_BLOCKS * BLOCK + 5)]


def poke(srv: VllmServer) -> None:
    """A request with no full block: vLLM steps (and publishes), hpkv saves nothing of it."""
    srv.completion([7, 8, 9], max_tokens=2, temperature=0)


def wait_events(
    srv: VllmServer, sub: Subscriber, cond: Callable[[list[Any]], Any], what: str, timeout: float = 60.0
):
    deadline = time.monotonic() + timeout
    while True:
        got = cond(sub.snapshot())
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}; events: {summary(sub.snapshot())}"
        poke(srv)
        time.sleep(0.15)


def summary(events: list[Any]) -> list[str]:
    out = []
    for e in events[-60:]:
        if isinstance(e, BlockStored):
            out.append(f"stored {e.medium} {len(e.block_hashes)}")
        elif isinstance(e, BlockRemoved):
            out.append(f"removed {e.medium} {len(e.block_hashes)}")
        else:
            out.append(type(e).__name__)
    return out


def gpu_hashes(events: list[Any], tokens: list[int]) -> list[Any]:
    """The hashes vLLM's own GPU events gave the prompt's full blocks, in order."""
    by_block: dict[tuple[int, ...], Any] = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "GPU":
            for j, h in enumerate(e.block_hashes):
                by_block[tuple(e.token_ids[j * BLOCK : (j + 1) * BLOCK])] = h
    blocks = [tuple(tokens[i * BLOCK : (i + 1) * BLOCK]) for i in range(len(tokens) // BLOCK)]
    return [by_block[b] for b in blocks if b in by_block]


def all_gpu_hashes(tokens: list[int]) -> Callable[[list[Any]], list[Any] | None]:
    """A wait condition: the hashes of every full block of the prompt, once vLLM published them."""

    def cond(events: list[Any]) -> list[Any] | None:
        h = gpu_hashes(events, tokens)
        return h if len(h) == PROMPT_BLOCKS else None

    return cond


def stored(events: list[Any], medium: str) -> dict[Any, tuple[Any, list[int]]]:
    """hash -> (parent hash, tokens) of every block published as stored in ``medium``."""
    out = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium == medium:
            parent = e.parent_block_hash
            for j, h in enumerate(e.block_hashes):
                out[h] = (parent, e.token_ids[j * e.block_size : (j + 1) * e.block_size])
                parent = h
    return out


def removed(events: list[Any], medium: str) -> set[Any]:
    return {h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}


def test_a_prompts_blocks_are_published_stored_in_dram_and_storage_then_removed_and_cleared(engine):
    srv, sub = engine
    a = prompt(1)
    srv.completion(a, max_tokens=4, temperature=0)
    hashes = wait_events(srv, sub, all_gpu_hashes(a), "the GPU's events")
    wait_events(srv, sub, lambda ev: set(hashes) <= set(stored(ev, "CPU")), "hpkv's DRAM events")
    wait_events(srv, sub, lambda ev: set(hashes) <= set(stored(ev, "STORAGE")), "hpkv's storage events")
    events = sub.snapshot()
    cpu = stored(events, "CPU")
    for i, h in enumerate(hashes):  # the same chain as vLLM's own: parent and tokens
        assert cpu[h] == (hashes[i - 1] if i else None, a[i * BLOCK : (i + 1) * BLOCK])
    assert all(e.block_size == BLOCK for e in events if isinstance(e, BlockStored) and e.medium != "GPU")

    # Two more prompts: the pool (16 blocks) and storage (16 files) evict the first one's blocks.
    later = []
    newest: list[int] = []
    for seed in (2, 3):
        p = newest = prompt(seed)
        srv.completion(p, max_tokens=4, temperature=0)
        hs = wait_events(srv, sub, all_gpu_hashes(p), "GPU")
        wait_events(
            srv, sub, lambda ev, hs=hs: set(hs) <= set(stored(ev, "STORAGE")), f"prompt {seed} on storage"
        )
        later += hs
    wait_events(srv, sub, lambda ev: set(hashes) <= removed(ev, "CPU"), "the first prompt evicted from DRAM")
    wait_events(
        srv, sub, lambda ev: set(hashes) <= removed(ev, "STORAGE"), "the first prompt evicted from storage"
    )
    assert not removed(sub.snapshot(), "CPU") & set(later[PROMPT_BLOCKS:]), "the newest prompt stays in DRAM"

    # reset_external: everything cleared, then what storage still holds is announced again.
    mark = len(sub.snapshot())
    r = requests.post(f"{srv.url}/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
    assert r.status_code == 200, r.text

    def after_reset(ev: list[Any]) -> bool:
        new = ev[mark:]
        cleared = [i for i, e in enumerate(new) if isinstance(e, AllBlocksCleared)]
        return bool(cleared) and set(later) <= set(stored(new[cleared[-1] :], "STORAGE"))

    wait_events(srv, sub, after_reset, "AllBlocksCleared and storage announced again")

    # The newest prompt again: a storage hit, read back into the pool: in DRAM again.
    mark = len(sub.snapshot())
    srv.completion(newest, max_tokens=4, temperature=0)
    wait_events(
        srv,
        sub,
        lambda ev: set(later[PROMPT_BLOCKS:]) <= set(stored(ev[mark:], "CPU")),
        "the promoted blocks in DRAM",
    )
    events = sub.snapshot()
    print("captured events:", summary(events))
    for kind, medium in (
        (BlockStored, "CPU"),
        (BlockStored, "STORAGE"),
        (BlockRemoved, "CPU"),
        (BlockRemoved, "STORAGE"),
    ):
        print(next(e for e in events if isinstance(e, kind) and e.medium == medium))
