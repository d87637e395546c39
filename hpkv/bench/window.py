"""Bytes a sliding-window hybrid stores and loads per prompt through hpkv's vLLM connector,
against a full-attention model of the same size (same layers, heads and dtype).

It runs the connector's scheduler side (the code that decides what is saved and what a hit
loads) against an in-memory store, with vLLM's KV cache groups as vLLM 0.32 forms them for
such a model: the layers of each attention kind in groups of as many layers as the rarer kind
has (Gemma-3-4B: 5 full-attention layers, 29 sliding-window ones: 1 + 6 groups of up to 5
layers, each block of a group one key of 5 layers' pages). No engine, no server: the bytes
follow from the save plan, which this measures, not from timing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from types import SimpleNamespace
from typing import Any


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM block size in tokens (default 16)")
    ap.add_argument(
        "--layers", type=int, default=34, help="decoder layers (default 34, Gemma-3-4B; 6 for the test model)"
    )
    ap.add_argument("--full-every", type=int, default=6, help="every Nth layer is full attention (default 6)")
    ap.add_argument("--window", type=int, default=1024, help="sliding window in tokens (default 1024)")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    ap.add_argument("--head-dim", type=int, default=256, help="head dimension (default 256; bf16 K and V)")
    ap.add_argument(
        "--chunk", type=int, default=2048, help="also prefill in chunks of this many tokens (default 2048)"
    )


def vllm_groups(layers: int, full_every: int) -> tuple[int, int, int]:
    """(layers a group, full-attention groups, sliding-window groups): vLLM 0.32's grouping of
    a hybrid whose layers share one page size (``kv_cache_utils``: groups of as many layers as
    the rarer kind has, or of the commoner kind's count when that is under 1.5 times as many;
    the last group of a kind padded)."""
    full = sum(1 for i in range(layers) if (i + 1) % full_every == 0)
    sliding = layers - full
    if full == 0 or sliding == 0:
        return layers, int(full > 0), int(sliding > 0)
    lo, hi = min(full, sliding), max(full, sliding)
    size = hi if hi < lo * 1.5 else lo
    return size, -(-full // size), -(-sliding // size)


class _Req(SimpleNamespace):
    pass


def _request(rid: str, tokens: int, block_size: int, salt: str = "") -> _Req:
    hashes = [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(tokens // block_size)]
    return _Req(
        request_id=rid,
        num_tokens=tokens,
        num_prompt_tokens=tokens,
        num_computed_tokens=0,
        block_hashes=hashes,
        kv_transfer_params=None,
    )


def _step(r: _Req, n: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=r.num_computed_tokens)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r.request_id: n},
        preempted_req_ids=set(),
    )


def measure(
    tokens: int,
    block_size: int,
    layers: int,
    full_every: int,
    window: int,
    kv_heads: int,
    head_dim: int,
    chunk: int,
) -> dict[str, Any]:
    """Stored and loaded bytes of one prompt (prefilled in one step and in chunks) and of its
    resend's hit, for the hybrid and for the same model with full attention only."""
    from hpkv.connectors.vllm.groups import FULL, GroupNeed
    from hpkv.connectors.vllm.layout import Layout
    from hpkv.connectors.vllm.scheduler import SchedulerSide
    from hpkv.testing.memory_store import MemoryKvStore

    page = block_size * kv_heads * head_dim * 2 * 2  # one layer's K and V of one block, bf16
    group_layers, n_full, n_sliding = vllm_groups(layers, full_every)
    wb = -(-(window - 1) // block_size)
    hybrid = (FULL,) * n_full + (GroupNeed(wb),) * n_sliding
    out: dict[str, Any] = {"page_bytes": page, "groups": len(hybrid), "group_layers": group_layers}

    def run(groups: tuple, num_layers: int, step_tokens: int, salt: str) -> tuple[int, int]:
        layout = Layout("ab" * 16, "window-bench", 1, block_size, num_layers, page, groups)
        store = MemoryKvStore(slot_bytes=layout.shard_bytes)
        tables: dict[str, list[list[int]]] = {}
        side = SchedulerSide(layout, 0, lambda: (store, 0), tables.get)
        side.hpkv.connect_now(timeout=5)
        stored = 0
        for rid in ("first", "resend"):
            r = _request(rid, tokens, block_size, salt)
            side.on_new_request(r)
            n, _ = side.get_num_new_matched_tokens(r, 0)
            n = n or 0
            blocks = tokens // block_size + 1
            tables[rid] = [list(range(1, blocks + 1)) for _ in groups]
            side.update_state_after_alloc(r, tables[rid], n)
            r.num_computed_tokens = n
            loaded = 0
            while r.num_computed_tokens < tokens:
                todo = min(step_tokens, tokens - r.num_computed_tokens)
                meta = side.build_connector_meta(_step(r, todo))
                for op in meta.saves:
                    store.commit(0, op.keys)
                    stored += len(op.keys) * layout.shard_bytes
                loaded += sum(len(op.keys) for op in meta.loads) * layout.shard_bytes
                r.num_computed_tokens += todo
            side.request_finished(rid)
            if rid == "resend":
                return stored, loaded
        raise AssertionError("unreachable")

    out["full_attention"] = run((FULL,), layers, tokens, "full")
    out["hybrid"] = run(hybrid, group_layers, tokens, "hybrid")
    out["hybrid_chunked"] = run(hybrid, group_layers, chunk, "chunked")
    out["every_block"] = len(hybrid) * (tokens // block_size) * group_layers * page  # before: all groups
    return out


def run(a: argparse.Namespace) -> int:
    r = measure(a.tokens, a.block_size, a.layers, a.full_every, a.window, a.kv_heads, a.head_dim, a.chunk)
    if getattr(a, "json", False):
        print(json.dumps(r))
        return 0
    mib = 1 << 20
    full_stored, full_loaded = r["full_attention"]
    print(
        f"{a.layers} layers (every {a.full_every}th full attention, the others a {a.window}-token window), "
        f"{a.kv_heads} KV heads x {a.head_dim}, bf16, block {a.block_size}: {r['groups']} KV cache groups "
        f"of {r['group_layers']} layers; one {a.tokens}-token prompt, then the same prompt again (its hit)"
    )
    rows = [
        ("full attention, same size", full_stored, full_loaded),
        ("hybrid, every block (hpkv before)", r["every_block"], None),
        ("hybrid, prefill in one step", *r["hybrid"]),
        (f"hybrid, prefill in {a.chunk}-token chunks", *r["hybrid_chunked"]),
    ]
    print(f"{'':40} {'stored MiB':>11} {'vs full':>8} {'hit loads MiB':>14} {'vs full':>8}")
    for name, stored, loaded in rows:
        load_s = (
            f"{loaded / mib:14.1f} {full_loaded / loaded:7.2f}x"
            if loaded is not None
            else f"{'-':>14} {'':>8}"
        )
        print(f"{name:40} {stored / mib:11.1f} {full_stored / stored:7.2f}x {load_s}")
    return 0
