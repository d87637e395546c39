"""``hpkv bench window``: the bytes a sliding-window hybrid stores and loads per prompt, from the
connector's own save plan (in-memory store, milliseconds)."""

from __future__ import annotations

from hpkv.bench.window import measure, vllm_groups


def test_vllms_grouping_of_hybrid_layers():
    assert vllm_groups(34, 6) == (5, 1, 6), "Gemma-3-4B: 5 full, 29 sliding (padded to 30)"
    assert vllm_groups(6, 6) == (1, 1, 5)
    assert vllm_groups(24, 2) == (12, 1, 1), "gpt-oss: 12 and 12"
    assert vllm_groups(8, 100) == (8, 0, 1), "no full-attention layer"


def test_a_window_group_stores_and_loads_its_window_and_the_full_group_every_block():
    page = 16 * 1 * 8 * 2 * 2
    r = measure(
        tokens=512, block_size=16, layers=6, full_every=6, window=64, kv_heads=1, head_dim=8, chunk=128
    )
    blocks, window = 512 // 16, 4  # cdiv(64 - 1, 16)
    assert r["full_attention"] == (blocks * 6 * page, (blocks - 1) * 6 * page), "the resend hits 31 blocks"
    # the window before the prompt's end and before a resend's hit (one block short): 5 blocks
    assert r["hybrid"] == ((blocks + 5 * (window + 1)) * page, (blocks - 1 + 5 * window) * page)
    assert r["hybrid_chunked"] == r["hybrid"], "a chunk's end is no hit point: nothing more stored"
    assert r["every_block"] == 6 * blocks * page
