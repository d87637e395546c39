"""KV events end to end with SGLang: a real SGLang on the CPU with CT-HPKV's ``--enable-ct-hpkv``
and ``--kv-events-config`` (ZMQ on loopback), hpkv spawned by it, and a ZMQ subscriber decoding
the msgpack batches as a router (Dynamo, llm-d) does.

SGLang publishes its own radix cache's events (medium ``GPU``); hpkv's plugin adds the pages
SGLang backed up to hpkv, with the same hashes, parents and tokens: medium ``EXTERNAL`` once a
page is in hpkv's DRAM pool, ``DISK`` once its file is written; ``BlockRemoved`` ``EXTERNAL``
when ``/hicache/storage-backend/clear`` drops the namespace from the pool; and after SGLang's
``/flush_cache`` (which publishes ``AllBlocksCleared``) the pages hpkv still holds again.

SGLang publishes while it steps: the test keeps it stepping with short requests ("pokes").
The test process has no SGLang: the events are decoded as plain msgpack (tagged maps, as
SGLang's ``KVCacheEvent`` documents).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import requests

from hpkv.testing.kv_events import Subscriber
from hpkv.testing.server import engine_env
from hpkv.testing.sglang_server import SglangServer, hpkv_backend_args, sglang_python

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(sglang_python() is None, reason="no .venv-sglang (scripts/setup-sglang.sh)"),
]

PAGE = 16


@pytest.fixture(scope="module")
def events_server(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SglangServer, Subscriber, dict]]:
    sub = Subscriber(lambda payload: msgspec.msgpack.decode(payload)[1])
    config = {"publisher": "zmq", "endpoint": sub.endpoint, "topic": "kv"}
    log = tmp_path_factory.mktemp("sglang-events") / "sglang.log"
    with engine_env("sglang-events", pool_size="256m", VLLM_HPKV_TOKEN_THRESHOLD="64") as env:
        args = [*hpkv_backend_args(), "--kv-events-config", json.dumps(config)]
        srv = SglangServer(tiny_model, extra_args=args, env=env, page_size=PAGE, log_path=log)
        try:
            srv.start().wait_ready()
            yield srv, sub, env
        except BaseException:
            print(srv.log_tail(150))
            raise
        finally:
            srv.stop()
            sub.close()


def poke_until(
    srv: SglangServer, sub: Subscriber, ok: Callable[[list[dict]], Any], what: str, timeout: float = 90
) -> Any:
    """Keep SGLang stepping (it publishes from its scheduler loop) until ``ok(events)`` is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        got = ok(sub.snapshot())
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s; events: {sub.snapshot()[-20:]}"
        srv.generate("Z Y", max_new_tokens=1, logprobs=False)
        time.sleep(0.3)


def stored(events: list[dict], medium: str) -> dict[int, tuple[int | None, list[int]]]:
    """hash → (parent hash, tokens) of every page announced as stored in ``medium``."""
    out: dict[int, tuple[int | None, list[int]]] = {}
    for e in events:
        if e.get("type") != "BlockStored" or e.get("medium", "GPU") != medium:
            continue
        parent, size = e.get("parent_block_hash"), e["block_size"]
        for i, h in enumerate(e["block_hashes"]):
            out[h] = (parent, e["token_ids"][i * size : (i + 1) * size])
            parent = h
    return out


def removed(events: list[dict], medium: str) -> set[int]:
    return {
        h
        for e in events
        if e.get("type") == "BlockRemoved" and e.get("medium") == medium
        for h in e["block_hashes"]
    }


def test_hpkv_pages_are_published_stored_in_dram_and_disk_with_sglangs_hashes_then_removed_and_announced_again(
    events_server: tuple[SglangServer, Subscriber, dict],
) -> None:
    srv, sub, _env = events_server
    rng = random.Random(31)
    prompt = " ".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(200))
    out = srv.generate(prompt, max_new_tokens=4, logprobs=False)
    pages = out["meta_info"]["prompt_tokens"] // PAGE  # full pages of the prompt

    def announced(events: list[dict]) -> Any:
        gpu, dram, disk = stored(events, "GPU"), stored(events, "EXTERNAL"), stored(events, "DISK")
        mine = [h for h in dram if h in gpu]
        return (gpu, dram, disk) if len(mine) >= pages and all(h in disk for h in mine) else None

    gpu, dram, disk = poke_until(srv, sub, announced, f"{pages} pages in EXTERNAL and DISK")
    # hpkv's pages are SGLang's: the same hashes, parents and tokens as its GPU events
    for h, (parent, tokens) in dram.items():
        assert h in gpu, "hpkv published a page SGLang never did"
        assert (parent, tokens) == gpu[h] == disk[h], h
    assert "hpkv: publishing KV events of the DRAM pool (medium EXTERNAL) and storage (DISK)" in srv.log_tail(
        200_000
    )

    # The namespace leaves hpkv's pool (the backend's clear): removed from EXTERNAL, not DISK.
    r = requests.post(f"{srv.url}/hicache/storage-backend/clear", timeout=60)
    assert r.status_code == 200, r.text
    poke_until(srv, sub, lambda ev: set(dram) <= removed(ev, "EXTERNAL"), "BlockRemoved EXTERNAL after clear")
    assert not removed(sub.snapshot(), "DISK") & set(dram), "the files were not removed"

    # SGLang's own flush publishes AllBlocksCleared: hpkv's files are announced again after it.
    n = len(sub.snapshot())
    srv.flush_cache()

    def again(events: list[dict]) -> bool:
        later = events[n:]
        cleared = next((i for i, e in enumerate(later) if e.get("type") == "AllBlocksCleared"), None)
        return cleared is not None and set(dram) <= set(stored(later[cleared:], "DISK"))

    poke_until(srv, sub, again, "the files announced again after AllBlocksCleared")
