"""Hybrid models (several vLLM KV cache groups): what a hit needs from each group, and the
scheduler side's lookups, loads and saves with a full-attention and a sliding-window group,
and with a full-attention and an SSM/linear-attention state group, against an in-memory store
(milliseconds; real vLLM in test_vllm_hybrid.py and test_vllm_ssm.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hpkv.connectors.vllm.groups import (
    FULL,
    STATE,
    GroupNeed,
    full_reach,
    group_needs,
    longest_hit,
    window_blocks_to_save,
)
from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.scheduler import NULL_BLOCK_ID, SchedulerSide
from hpkv.protocol.keys import block_keys
from hpkv.testing.memory_store import MemoryKvStore

BS = 16
NS = 3
WINDOW = GroupNeed(window_blocks=2)
HYBRID = Layout(
    fingerprint="cd" * 16, name="unit-hybrid", world_size=1, block_size=BS, num_layers=1, page_bytes=64,
    groups=(FULL, WINDOW),
)  # fmt: skip


def have(*bits: int) -> list[bool]:
    return [bool(b) for b in bits]


# ---------------------------------------------------------------------------- the rule


def test_full_attention_needs_every_block_before_the_hit():
    assert list(FULL.needed(2, 6)) == [2, 3, 4, 5]
    assert longest_hit([FULL], [have(1, 1, 0, 1)], 0, 4) == 2


def test_a_sliding_window_needs_only_its_last_blocks_before_the_hit():
    assert list(WINDOW.needed(0, 6)) == [4, 5]
    assert list(WINDOW.needed(5, 6)) == [5], "blocks below the engine's own hit are the engine's"
    # blocks 0-1 missing: no hit at 1 or 2 blocks, but one at 4 (needs blocks 2, 3)
    assert longest_hit([WINDOW], [have(0, 0, 1, 1)], 0, 4) == 4


def test_the_hit_is_the_longest_length_at_which_every_group_has_what_it_needs():
    full = have(1, 1, 1, 1, 1, 0)
    window = have(0, 1, 1, 0, 1, 1)
    # full allows up to 5; the window at 5 needs blocks 3, 4 (3 missing), at 4 needs 2, 3
    # (3 missing), at 3 needs 1, 2: the hit is 3 blocks
    assert longest_hit([FULL, WINDOW], [full, window], 0, 6) == 3


def test_no_hit_when_a_group_misses_the_first_block():
    assert longest_hit([FULL, WINDOW], [have(0, 1), have(1, 1)], 0, 2) == 0
    assert longest_hit([FULL, WINDOW], [have(1, 1), have(0, 0)], 4, 6) == 4, "no hit: the engine's own"


def test_a_window_of_one_token_needs_no_block():
    assert list(GroupNeed(window_blocks=0).needed(0, 3)) == []
    assert longest_hit([FULL, GroupNeed(0)], [have(1, 1), have(0, 0)], 0, 2) == 2


def test_the_full_groups_reach_ends_at_their_first_missing_block():
    assert full_reach([FULL, WINDOW], [have(1, 1, 0, 1), have(0, 0, 0, 0)], 0, 4) == 2
    assert full_reach([FULL, WINDOW], [have(1, 1), have(0, 0)], 4, 6) == 6
    assert full_reach([WINDOW], [have(0, 0)], 0, 2) == 2, "no full group: it limits nothing"


def test_a_window_group_saves_the_window_before_each_point_once():
    done: set[int] = set()
    assert window_blocks_to_save(WINDOW, [6], done, 6) == [4, 5]
    assert window_blocks_to_save(WINDOW, [6, 7], done, 7) == [6], "block 5 is saved already"
    assert window_blocks_to_save(WINDOW, [3, 9], done, 8) == [1, 2], "9 is not computed yet"
    assert window_blocks_to_save(WINDOW, [1, 0], done, 8) == [0]
    assert done == {0, 1, 2, 4, 5, 6}
    assert window_blocks_to_save(FULL, [3], set(), 5) == [0, 1, 2], "a full group needs every block"


def test_group_needs_follow_vllms_specs():
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    def config(*specs):
        groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    shape = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    full = FullAttentionSpec(**shape)
    # vLLM allocates cdiv(window - 1, block) blocks before a hit: 64 tokens -> 2 blocks of 32,
    # 65 -> 2, 66 -> 3
    assert group_needs(config(full, SlidingWindowSpec(sliding_window=64, **shape)), 32) == (
        FULL,
        GroupNeed(2),
    )
    assert group_needs(config(full, SlidingWindowSpec(sliding_window=66, **shape)), 32) == (
        FULL,
        GroupNeed(3),
    )
    assert group_needs(config(full), 32) == (FULL,)
    state = dict(block_size=32, shapes=((4,),), dtypes=(torch.float32,))
    assert group_needs(config(full, MambaSpec(mamba_cache_mode="align", **state)), 32) == (FULL, STATE)
    assert group_needs(config(MambaSpec(mamba_cache_mode="align", **state)), 32) == (STATE,), "not full"
    with pytest.raises(NotImplementedError, match="MambaSpec.*--mamba-cache-mode align"):
        group_needs(config(full, MambaSpec(**state)), 32)  # vLLM's default "none": no state kept by block
    with pytest.raises(NotImplementedError, match="block size 64"):
        group_needs(config(full, MambaSpec(mamba_cache_mode="align", **{**state, "block_size": 64})), 32)
    with pytest.raises(NotImplementedError, match="speculative"):
        group_needs(config(full, MambaSpec(mamba_cache_mode="align", num_speculative_blocks=1, **state)), 32)


def test_a_state_group_needs_the_one_block_that_holds_the_state_at_the_hit():
    assert STATE.tag == "state", "its blocks mean something else than a window's"
    assert GroupNeed(1).tag == "window1"
    assert list(STATE.needed(0, 6)) == [5]
    assert list(STATE.needed(6, 6)) == [], "the engine's own hit holds its state"
    # full attention has 6 blocks, the state is there after 2 and 4 blocks only: the hit is 4
    assert longest_hit([FULL, STATE], [have(1, 1, 1, 1, 1, 1), have(0, 1, 0, 1, 0, 0)], 0, 6) == 4
    assert longest_hit([FULL, STATE], [have(1, 1, 0, 1), have(0, 1, 0, 1)], 0, 4) == 2, "full stops at 2"
    assert longest_hit([FULL, STATE], [have(1, 1), have(0, 0)], 0, 2) == 0
    with pytest.raises(ValueError, match="one block"):
        GroupNeed(2, state=True)


def test_group_zero_keeps_the_keys_hpkv_always_wrote():
    import hashlib as h

    fp, bh = "ab" * 16, b"x" * 32
    legacy = h.blake2b(bh, digest_size=16, key=bytes.fromhex(fp)).digest()
    assert block_keys(fp, [bh]) == block_keys(fp, [bh], 0) == [legacy]
    assert block_keys(fp, [bh], 1) != [legacy], "each group has its own keys"


# ---------------------------------------------------------------------------- the scheduler side


@dataclass
class Req:
    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    kv_transfer_params: dict | None = None


def request(rid: str, blocks: int, prefix: str = "p") -> Req:
    hashes = [hashlib.sha256(f"{prefix}/{i}".encode()).digest() for i in range(blocks)]
    return Req(rid, blocks * BS + 3, block_hashes=hashes)


def step(r: Req, n: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=r.num_computed_tokens)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r.request_id: n},
        preempted_req_ids=set(),
    )


class HybridEngine:
    """The scheduler side with vLLM's hybrid block tables faked: group 0 (full attention) holds
    blocks 100.., group 1 (window of 2 blocks) 200.., with the null block outside the window
    below ``computed`` tokens, as vLLM's SlidingWindowManager leaves it."""

    def __init__(self, threshold: int = 0):
        self.store = MemoryKvStore()
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        self.side = SchedulerSide(HYBRID, threshold, lambda: (self.store, NS), self.tables.get)
        self.side.hpkv.connect_now(timeout=5)

    def table(self, r: Req, computed_blocks: int, base: int) -> tuple[list[int], list[int]]:
        n = r.num_tokens // BS + 1
        skipped = max(0, computed_blocks - WINDOW.window_blocks)
        window = [NULL_BLOCK_ID] * skipped + [base + 200 + i for i in range(skipped, n)]
        return [base + 100 + i for i in range(n)], window

    def admit(self, r: Req, base: int = 0) -> tuple[int | None, bool]:
        self.side.on_new_request(r)
        n, background = self.side.get_num_new_matched_tokens(r, r.num_computed_tokens)
        self.tables[r.request_id] = self.table(r, (r.num_computed_tokens + (n or 0)) // BS, base)
        self.side.update_state_after_alloc(r, self.tables[r.request_id], n or 0)
        return n, background

    def save_all(self, meta) -> None:
        for op in meta.saves:
            self.store.commit(NS, op.keys)

    def save_all_and_finish(self, r: Req, save) -> None:
        self.store.commit(NS, save.keys)
        self.side.request_finished(r.request_id)

    def computed(self, r: Req) -> None:
        """``r`` is prefilled, all its blocks saved, and finished."""
        self.admit(r)
        self.save_all(self.side.build_connector_meta(step(r, r.num_tokens)))
        self.side.request_finished(r.request_id)


def keys(r: Req, group: int, blocks: range) -> list[bytes]:
    return block_keys(HYBRID.fingerprint, [r.block_hashes[i] for i in blocks], group)


def test_a_miss_saves_every_full_block_and_only_the_window_before_the_prompts_end():
    e = HybridEngine()
    r = request("a", 5)
    assert e.admit(r) == (0, False)
    (save,) = e.side.build_connector_meta(step(r, r.num_tokens)).saves
    full, window = e.tables["a"]
    assert save.keys == keys(r, 0, range(5)) + keys(r, 1, range(3, 5))
    assert save.block_ids == full[:5] + window[3:5]


def test_a_chunked_prefill_saves_the_window_of_its_last_chunk_only():
    e = HybridEngine()
    r = request("a", 8)  # 8 blocks and 3 tokens, prefilled in chunks of 3 blocks
    e.admit(r)
    full, window = e.tables["a"]
    saved: list[int] = []
    for chunk in (3 * BS, 3 * BS, 2 * BS + 3):
        (save,) = e.side.build_connector_meta(step(r, chunk)).saves
        saved += save.block_ids
        r.num_computed_tokens += chunk
    assert saved == full[:3] + full[3:6] + full[6:8] + window[6:8]


def test_a_last_chunk_within_the_last_block_finds_the_prompts_window_saved_already():
    e = HybridEngine()
    r = request("a", 8)  # 8 blocks and 3 tokens: a chunk of 8 blocks and 1 token, then 2 tokens
    e.admit(r)
    full, window = e.tables["a"]
    (save,) = e.side.build_connector_meta(step(r, 8 * BS + 1)).saves
    assert save.block_ids == full[:8] + window[6:8], "saved while vLLM still holds them"
    r.num_computed_tokens = 8 * BS + 1
    assert e.side.build_connector_meta(step(r, 2)).saves == []


def test_decode_saves_each_new_block_of_the_window_group_too():
    e = HybridEngine()
    r = request("a", 4)  # 4 blocks and 3 tokens
    e.admit(r)
    e.side.build_connector_meta(step(r, r.num_tokens))
    r.num_computed_tokens = r.num_tokens
    e.store.calls.clear()
    for _ in range(BS - 3):  # decoding fills block 4
        r.num_tokens += 1
        r.block_hashes = request("a", r.num_tokens // BS).block_hashes
        meta = e.side.build_connector_meta(step(r, 1))
        r.num_computed_tokens += 1
    (save,) = meta.saves
    assert save.keys == keys(r, 0, range(4, 5)) + keys(r, 1, range(4, 5))
    assert e.store.calls.count("reserve") == 1, "a step that completes no block asks nothing"


def test_a_prompt_of_whole_blocks_saves_the_window_its_resend_hits():
    e = HybridEngine()
    a = request("a", 6)
    a.num_tokens = 6 * BS  # a resend hits at most 5 blocks: the last token is computed
    e.computed(a)
    b = request("b", 6)
    b.num_tokens = 6 * BS
    assert e.admit(b, base=1000)[0] == 5 * BS
    (load,) = e.side.build_connector_meta(step(b, BS)).loads
    assert load.keys == keys(b, 0, range(5)) + keys(b, 1, range(3, 5))


def test_the_next_turn_of_a_conversation_hits_the_whole_previous_one():
    e = HybridEngine()
    e.computed(request("a", 6))
    b = request("b", 9)  # the same 6 blocks, and more
    assert e.admit(b, base=1000)[0] == 6 * BS
    (load,) = e.side.build_connector_meta(step(b, 3 * BS)).loads
    assert load.keys == keys(b, 0, range(6)) + keys(b, 1, range(4, 6))


def test_a_shared_prefix_hits_from_the_second_prompt_that_parts_there_on():
    """A system prompt of 4 blocks: the first prompt's windows end at its own end; the second
    prompt finds every full block of the prefix but no window there, and saves that window;
    from the third on, prompts sharing the prefix hit it."""
    e = HybridEngine()

    def shared(rid: str) -> Req:
        r = request(rid, 7, prefix=rid)
        r.block_hashes[:4] = request("system", 4, prefix="system").block_hashes
        return r

    e.computed(shared("a"))
    b = shared("b")
    e.store.calls.clear()
    assert e.admit(b, base=1000)[0] == 0, "no window before block 4 yet"
    assert e.store.calls.count("lookup") == 1
    (save,) = e.side.build_connector_meta(step(b, b.num_tokens)).saves
    assert save.keys == keys(b, 0, range(4, 7)) + keys(b, 1, range(2, 4)) + keys(b, 1, range(5, 7))
    e.save_all_and_finish(b, save)
    c = shared("c")
    assert e.admit(c, base=2000)[0] == 4 * BS
    (load,) = e.side.build_connector_meta(step(c, 3 * BS)).loads
    assert load.keys == keys(c, 0, range(4)) + keys(c, 1, range(2, 4))


def test_one_lookup_finds_the_hit_and_each_group_loads_what_it_needs():
    e = HybridEngine()
    e.computed(request("a", 6))

    b = request("b", 6)
    e.store.calls.clear()
    n, background = e.admit(b, base=1000)
    assert n == 6 * BS
    assert background, "a hybrid model's loads run in the background: a failure is then reported by request"
    assert e.store.calls.count("lookup") == 1, "one lookup for all groups"
    (load,) = e.side.build_connector_meta(step(b, 3)).loads
    full, window = e.tables["b"]
    assert load.keys == keys(b, 0, range(6)) + keys(b, 1, range(4, 6))
    assert load.block_ids == full[:6] + window[4:6], "the window loads only its last 2 blocks"
    assert NULL_BLOCK_ID not in load.block_ids
    assert e.side.build_connector_meta(step(b, 3)).saves == [], "loaded blocks are not saved back"


def test_a_prompt_longer_than_one_lookup_call_holds_hits_its_first_part(monkeypatch):
    from hpkv.connectors.vllm import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "MAX_KEYS_PER_CALL", 8)  # 4 blocks of 2 groups a call
    e = HybridEngine()
    e.computed(request("a", 6))
    e.store.calls.clear()
    n, _ = e.admit(request("b", 6), base=1000)
    assert n == 0 and e.store.calls.count("lookup") == 1, "one call, capped: no window before block 4"
    e.side.request_finished("b")
    e.computed(request("b", 6))  # saves the window before block 4, where its lookup stopped
    e.store.calls.clear()
    n, _ = e.admit(request("c", 6), base=2000)
    assert n == 4 * BS and e.store.calls.count("lookup") == 1, "the rest is recomputed"


def test_a_window_block_outside_vllms_window_is_never_saved():
    e = HybridEngine()
    r = request("a", 6)
    r.num_computed_tokens = 4 * BS  # vLLM's own hit: its window group holds nulls below block 2
    e.admit(r)
    (save,) = e.side.build_connector_meta(step(r, r.num_tokens - r.num_computed_tokens)).saves
    full, window = e.tables["a"]
    assert window[:2] == [NULL_BLOCK_ID] * 2
    assert save.block_ids == full[:6] + window[2:6]
    assert save.keys == keys(r, 0, range(6)) + keys(r, 1, range(2, 6))


def test_a_missing_window_block_shortens_the_hit_to_where_every_group_has_its_blocks():
    e = HybridEngine()
    e.computed(request("a", 4))
    r = request("a2", 6)  # its next turn, which hits the 4 blocks
    assert e.admit(r)[0] == 4 * BS
    r.num_computed_tokens = 4 * BS
    meta = e.side.build_connector_meta(step(r, r.num_tokens - 4 * BS))
    (save,) = meta.saves
    missing = keys(r, 1, range(4, 5))[0]  # the window group's block 4 was never written
    e.store.commit(NS, [k for k in save.keys if k != missing])
    e.store.abort(NS, [missing])
    e.side.request_finished(r.request_id)

    b = request("b", 6)
    assert e.admit(b)[0] == 4 * BS, "hits at 5 and 6 blocks need window block 4"
    (load,) = e.side.build_connector_meta(step(b, 3)).loads
    assert load.keys == keys(b, 0, range(4)) + keys(b, 1, range(2, 4))


def test_a_hit_after_the_engines_own_loads_only_blocks_past_it():
    e = HybridEngine()
    e.computed(request("a", 6))

    b = request("b", 6)
    b.num_computed_tokens = 3 * BS  # vLLM's own prefix cache holds 3 blocks of every group
    assert e.admit(b, base=1000)[0] == 3 * BS
    (load,) = e.side.build_connector_meta(step(b, 3)).loads
    full, window = e.tables["b"]
    assert load.block_ids == full[3:6] + window[4:6]


# ---------------------------------------------------------------------------- an SSM hybrid

SSM = Layout(
    fingerprint="ef" * 16, name="unit-ssm", world_size=1, block_size=BS, num_layers=1, page_bytes=64,
    groups=(FULL, STATE),
)  # fmt: skip


def offered(s: SimpleNamespace, rid: str, *states: tuple[int, int]) -> SimpleNamespace:
    """``s`` with vLLM's hand-off of the state group's (block id, tokens) ``states``."""
    s.kv_connector_block_state = SimpleNamespace(
        boundary_state_offloads={rid: [(1, block, tokens) for block, tokens in states]}
    )
    return s


class SsmEngine:
    """The scheduler side of a full-attention group (blocks 100..) and a state group: vLLM's
    align mode frees a state block once the next one holds the running state, so the state
    table holds the null block except where a hit's state is (block 300 + i at i)."""

    def __init__(self):
        self.store = MemoryKvStore()
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        self.side = SchedulerSide(SSM, 0, lambda: (self.store, NS), self.tables.get)
        self.side.hpkv.connect_now(timeout=5)

    def admit(self, r: Req) -> int | None:
        self.side.on_new_request(r)
        n, _ = self.side.get_num_new_matched_tokens(r, r.num_computed_tokens)
        hit = (r.num_computed_tokens + (n or 0)) // BS
        blocks = r.num_tokens // BS + 1
        state = [300 + i if i == hit - 1 else NULL_BLOCK_ID for i in range(blocks)]
        self.tables[r.request_id] = ([100 + i for i in range(blocks)], state)
        self.side.update_state_after_alloc(r, self.tables[r.request_id], n or 0)
        return n

    def computed(self, r: Req, *states: tuple[int, int]) -> None:
        """``r`` prefilled in one step that handed ``states`` over, saved, finished."""
        self.admit(r)
        for op in self.side.build_connector_meta(offered(step(r, r.num_tokens), r.request_id, *states)).saves:
            self.store.commit(NS, op.keys)
        self.side.request_finished(r.request_id)


def ssm_keys(r: Req, group: int, blocks: range | list[int]) -> list[bytes]:
    return block_keys(SSM.fingerprint, [r.block_hashes[i] for i in blocks], group)


def test_a_state_group_saves_the_states_vllm_hands_over_under_the_block_before_them():
    e = SsmEngine()
    r = request("a", 5)  # 5 blocks and 3 tokens
    e.admit(r)
    # vLLM computed up to 4 blocks in a step, and hands over the state after 4 blocks (in
    # block 77), one after 5 blocks and 3 tokens (a sub-block tail: no hit lands there) and
    # one past the hashed blocks
    s = offered(step(r, 4 * BS), "a", (77, 4 * BS), (78, 5 * BS + 3), (79, 9 * BS))
    (save,) = e.side.build_connector_meta(s).saves
    assert save.keys == ssm_keys(r, 0, range(4)) + ssm_keys(r, 1, [3])
    assert save.block_ids == [100, 101, 102, 103, 77]
    r.num_computed_tokens = 4 * BS
    (save,) = e.side.build_connector_meta(offered(step(r, BS + 3), "a", (77, 4 * BS))).saves
    assert save.keys == ssm_keys(r, 0, [4]), "a state is saved once; none is taken by position"


def test_an_ssm_hybrid_hits_where_a_state_was_saved_and_loads_that_state_only():
    e = SsmEngine()
    e.computed(request("a", 6), (50, 2 * BS), (51, 4 * BS))  # states after 2 and 4 blocks
    b = request("b", 6)
    e.store.calls.clear()
    assert e.admit(b) == 4 * BS, "no state after 5 or 6 blocks: the hit is 4"
    assert e.store.calls.count("lookup") == 1
    (load,) = e.side.build_connector_meta(step(b, 2 * BS)).loads
    assert load.keys == ssm_keys(b, 0, range(4)) + ssm_keys(b, 1, [3])
    assert load.block_ids == [100, 101, 102, 103, 303], "the state loads into the block vLLM starts from"
    assert load.tokens == 4 * BS


def test_an_ssm_hybrid_without_a_state_has_no_hit():
    e = SsmEngine()
    e.computed(request("a", 6))  # vLLM handed no state over
    assert e.admit(request("b", 6)) == 0


# ---------------------------------------------------------------------------- the worker side


class FailingMover:
    """Copies nothing; the load of blocks in ``bad`` fails."""

    def __init__(self, bad: set[int] = frozenset()):  # type: ignore[assignment]
        self.bad = bad

    def load(self, blocks, offsets) -> bool:
        return not any(int(b) in self.bad for b in blocks)

    def save(self, blocks, offsets) -> bool:
        return True


def hybrid_worker(store: MemoryKvStore, mover: FailingMover):
    from hpkv.connectors.vllm.worker import WorkerSide

    side = WorkerSide(HYBRID, 0, "/nonexistent", "cpu", open_store=lambda spec: (store, NS, mover))
    side._device = mover  # connected (open_store would do it on first use)
    return side


def dram_blocks(store: MemoryKvStore, n: int) -> tuple[list[bytes], object]:
    ks = block_keys(HYBRID.fingerprint, [f"b{i}".encode() for i in range(n)], 1)
    store.reserve(NS, ks)
    store.commit(NS, ks)
    return ks, store.pin(NS, ks)


def test_a_hybrid_models_failed_load_is_reported_by_request_not_by_block():
    from hpkv.connectors.vllm.metadata import LoadOp

    store = MemoryKvStore(slot_bytes=HYBRID.shard_bytes)
    side = hybrid_worker(store, FailingMover(bad={101}))
    ks, offsets = dram_blocks(store, 3)
    good, bad = LoadOp("good", ks[:1], [100], offsets[:1]), LoadOp("bad", ks[1:], [101, 102], offsets[1:])
    side.load(store, NS, [good], lambda exc: None)
    side.load(store, NS, [bad], lambda exc: None)
    assert side.take_load_errors() == set(), "vLLM cannot map a hybrid model's block ids to requests"
    assert side.take_failed_loads({"good"}) == set()
    assert side.take_failed_loads(set()) == set(), "a failure is reported with the request's finish"
    assert side.take_failed_loads({"bad", "good"}) == {"bad"}


def test_a_hybrid_load_counts_the_tokens_of_its_hit_not_its_keys():
    from hpkv.connectors.vllm.metadata import LoadOp

    store = MemoryKvStore(slot_bytes=HYBRID.shard_bytes)
    side = hybrid_worker(store, FailingMover())
    ks, offsets = dram_blocks(store, 3)  # e.g. 2 full-attention blocks and 1 window block
    side.load(store, NS, [LoadOp("r", ks, [100, 101, 102], offsets, tokens=2 * BS)], lambda exc: None)
    stats = side.take_stats()
    assert stats is not None and stats.data["loaded_tokens_dram"] == 2 * BS


def test_a_state_layers_padded_page_is_copied_whole():
    """vLLM views an SSM layer's pages as int8 state of ``content`` bytes a block, padded to the
    attention page (block stride = page): hpkv copies the whole page."""
    import torch

    from hpkv.connectors.vllm.layout import describe_kv

    blocks, page, content = 4, 64, 40
    raw = torch.zeros(blocks * page, dtype=torch.int8)
    state = raw.as_strided((blocks, 1, 1, content), (page, content, content, 1))
    layout = Layout("ef" * 16, "unit", 1, BS, 1, page, (FULL, STATE))
    for kv_caches in ({"gdn": state}, {"gdn": state, "attn": raw.view(blocks, page)}):  # groups overlay
        kv = describe_kv(layout, kv_caches, "/x", raw.data_ptr(), raw.numel())
        assert (kv["block_stride"], kv["page_bytes"], kv["num_blocks"]) == (page, page, blocks)
    with pytest.raises(ValueError, match="unsupported KV cache tensor layout"):
        narrow = raw.as_strided((blocks, content), (content + 8, 1))  # a stride that is not the page
        describe_kv(layout, {"gdn": narrow}, "/x", raw.data_ptr(), raw.numel())


def test_a_padded_page_that_would_be_copied_past_its_memory_is_refused_at_registration():
    """The whole-page copy of a state layer's last block takes ``page - content`` bytes past the
    tensor's last element: describe_kv refuses a layout where those bytes are not the layer's own
    (past the allocation, or another layer's first page), naming the sizes."""
    import torch

    from hpkv.connectors.vllm.layout import describe_kv

    blocks, page, content = 4, 64, 40
    raw = torch.zeros(2 * blocks * page, dtype=torch.int8)

    def state(at: int, n: int = blocks) -> torch.Tensor:
        return raw.as_strided((n, 1, 1, content), (page, content, content, 1), at)

    def describe(layers: int, kv_caches: dict[str, torch.Tensor], size: int = raw.numel()) -> dict:
        layout = Layout("ef" * 16, "unit", 1, BS, layers, page, (FULL, STATE))
        return describe_kv(layout, kv_caches, "/x", raw.data_ptr(), size)

    tight = (blocks - 1) * page + content  # the allocation ends at the last block's last state byte
    with pytest.raises(ValueError, match=rf"4 pages of {page} bytes .* end at byte 256, past the shared-"):
        describe(1, {"gdn": state(0)}, size=tight)
    with pytest.raises(
        ValueError, match=rf"end at byte 256, past the next layer's first page at byte {tight}"
    ):
        describe(2, {"gdn.0": state(0), "gdn.1": state(tight)})
    with pytest.raises(ValueError, match=r"different block counts \[3, 4\]"):  # block 3 would pass 0's end
        describe(2, {"gdn.0": state(0, 3), "gdn.1": state(blocks * page)})
    kv = describe(2, {"gdn.0": state(0), "gdn.1": state(blocks * page)})
    assert (kv["layer_bases"], kv["num_blocks"]) == ([(0, 0), (0, blocks * page)], blocks)


def test_a_hit_whose_state_block_vllm_did_not_allocate_is_recomputed_not_run_from_no_state():
    from hpkv.connectors.vllm.metadata import LoadOp

    e = SsmEngine()
    e.computed(request("a", 4), (50, 4 * BS))
    c = request("c", 4)
    e.side.on_new_request(c)
    assert e.side.get_num_new_matched_tokens(c, 0)[0] == 4 * BS
    full, state = [100, 101, 102, 103, 104], [NULL_BLOCK_ID] * 5  # no block where the state loads
    e.side.update_state_after_alloc(c, (full, state), 4 * BS)
    (load,) = e.side.build_connector_meta(step(c, 3)).loads
    assert load.block_ids == [100, 101, 102, 103, NULL_BLOCK_ID], "kept, for the worker to refuse"

    store = MemoryKvStore(slot_bytes=SSM.shard_bytes)
    side = hybrid_worker(store, FailingMover())
    ks, offsets = dram_blocks(store, 2)
    good = LoadOp("good", ks[:1], [100], offsets[:1])
    side.load(store, NS, [good, LoadOp("c", ks[1:], [NULL_BLOCK_ID], offsets[1:])], lambda exc: None)
    assert side.take_failed_loads({"c", "good"}) == {"c"}
