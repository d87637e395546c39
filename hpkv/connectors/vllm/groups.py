"""What a prefix hit needs from each of vLLM's KV cache groups, and the longest hit they allow.

vLLM's hybrid KV cache manager keeps one KV cache group per attention kind (Gemma 3: one
full-attention group, several sliding-window groups), each with its own blocks for the same
token positions. A hit at a prefix of ``n`` blocks needs, from each group:

* full attention: every block before ``n``;
* sliding window of ``w`` tokens: the last ``cdiv(w - 1 + extra_retained, block_size)``
  blocks before ``n``, exactly the blocks vLLM allocates for that group when ``n`` blocks are
  computed (``SlidingWindowManager.get_num_skipped_tokens``); the earlier ones are vLLM's
  null block and are never read;
* SSM/linear-attention state (``MambaSpec`` in vLLM's ``mamba_cache_mode="align"``, prefix
  caching on): the one block ``n - 1``, which holds the recurrent state (conv + SSM state of
  each of the group's layers) after exactly ``n`` blocks of tokens (vLLM's align-mode
  invariant; ``MambaManager`` allocates the state of an external hit of ``n`` blocks there and
  the model runner starts from it). A one-block window.

Blocks below the engine's own prefix-cache hit (``first``) are the engine's and need nothing
from hpkv. The hit is the longest ``n`` at which every group has what it needs.

What is saved follows: a full-attention group saves every block, a sliding-window group only
its window before each length a later hit can land on (:func:`window_blocks_to_save`): the end
of what a request computed once its prompt is done (a later prompt extending this one, the
next turn of a conversation, hits there; in decode every new block is such an end), the
longest hit a resent prompt can have (one block short of a prompt of whole blocks), and the
lengths where other prompts were seen to part from this one (the end of a full-attention
prefix whose windows were missing: a shared system prompt, hit there from the next request
on). The blocks before a window are vLLM's null block by the time the next chunk runs.

A state group saves only states vLLM itself materialized: its block table is not append-only
(interior states are freed, the running state moves on), so a state block at ``n - 1`` holds
the state at ``n`` blocks only in the step that computed up to exactly there. vLLM hands those
over with their exact block ids (``KVConnectorBlockState.boundary_state_offloads``: every state
it retains for its own prefix cache: block-aligned prefill chunk ends, decode block ends).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class GroupNeed:
    """What one KV cache group needs for a hit: every block (``window_blocks`` None, full
    attention) or the last ``window_blocks`` blocks before the hit (sliding window; an
    SSM/linear-attention ``state`` group: the one block holding the state at the hit)."""

    window_blocks: int | None = None
    state: bool = False  # recurrent state (MambaSpec, align mode): window_blocks is 1

    def __post_init__(self) -> None:
        if self.state and self.window_blocks != 1:
            raise ValueError(f"a state group needs one block, not window_blocks={self.window_blocks}")

    @property
    def tag(self) -> str:
        """The group's entry in the namespace (its blocks' meaning)."""
        if self.state:
            return "state"
        return "full" if self.window_blocks is None else f"window{self.window_blocks}"

    def needed(self, first: int, n: int) -> range:
        """The blocks in ``[first, n)`` a hit at ``n`` blocks needs from this group."""
        lo = first if self.window_blocks is None else max(first, n - self.window_blocks)
        return range(lo, n)


FULL = GroupNeed()
#: An SSM/linear-attention group (vLLM's ``MambaSpec``, ``mamba_cache_mode="align"``).
STATE = GroupNeed(1, state=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_needs(kv_cache_config: KVCacheConfig, block_size: int) -> tuple[GroupNeed, ...]:
    """The needs of the engine's KV cache groups, in vLLM's group order. NotImplementedError
    for a group hpkv cannot serve yet (Mamba/linear-attention state without vLLM's align mode,
    chunked local attention, per-group block sizes); a single group of another kind is served
    as full attention, as before hybrid support."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    needs: list[GroupNeed] = []
    for i, group in enumerate(groups):
        spec: Any = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "align":
                raise NotImplementedError(
                    f"this is an SSM/linear-attention hybrid (KV cache group {i} holds "
                    f"{type(spec).__name__} recurrent state) with mamba_cache_mode={mode!r}: vLLM keeps "
                    "no state at block boundaries, so no prefix can be restored; start vLLM with "
                    "--enable-prefix-caching --mamba-cache-mode align for hpkv to serve it (vLLM serves "
                    "the model without hpkv meanwhile; remove --kv-transfer-config to silence this)"
                )
            if spec.block_size != block_size:
                raise NotImplementedError(
                    f"KV cache group {i} ({type(spec).__name__}) has block size {spec.block_size}, the "
                    f"engine {block_size}: hpkv serves hybrid models whose groups share one block size"
                )
            if getattr(spec, "num_speculative_blocks", 0):
                raise NotImplementedError(
                    f"KV cache group {i} ({type(spec).__name__}) keeps speculative-decoding state "
                    "blocks: hpkv serves SSM hybrids without speculative decoding only"
                )
            needs.append(STATE)
        elif type(spec) is SlidingWindowSpec:
            if spec.block_size != block_size:
                raise NotImplementedError(
                    f"KV cache group {i} has block size {spec.block_size}, the engine {block_size}: "
                    "hpkv serves hybrid models whose groups share one block size"
                )
            reach = spec.sliding_window - 1 + spec.extra_retained_tokens
            needs.append(GroupNeed(_cdiv(max(reach, 0), block_size)))
        elif type(spec) is FullAttentionSpec or len(groups) == 1:
            if len(groups) > 1 and spec.block_size != block_size:
                raise NotImplementedError(
                    f"KV cache group {i} has block size {spec.block_size}, the engine {block_size}: "
                    "hpkv serves hybrid models whose groups share one block size"
                )
            needs.append(FULL)
        else:
            raise NotImplementedError(
                f"KV cache group {i} is {type(spec).__name__}: hpkv serves hybrid models of full "
                "and sliding-window attention only; vLLM serves the model without hpkv "
                "(remove --kv-transfer-config to silence this)"
            )
    return tuple(needs)


def has_recurrent_state(vllm_config: VllmConfig) -> bool:
    """True for an SSM/linear-attention model (vLLM's ``has_inner_state``) that hpkv cannot
    serve: one without vLLM's ``mamba_cache_mode="align"``, whose Mamba groups make
    :func:`group_needs` refuse it, which the engine only learns with its KV cache config;
    known earlier, hpkv starts no server for it."""
    try:
        inner = bool(vllm_config.model_config.has_inner_state)
    except (AttributeError, RuntimeError):  # no model config, or a registry that cannot tell
        return False
    return inner and getattr(vllm_config.cache_config, "mamba_cache_mode", "none") != "align"


def longest_hit(needs: Sequence[GroupNeed], present: Sequence[Sequence[bool]], first: int, last: int) -> int:
    """The longest prefix, in blocks, hpkv can complete: the largest ``n`` in ``(first, last]``
    at which every group ``g`` has each block it needs (``present[g][i - first]`` for block
    ``i`` in ``[first, last)``); ``first`` when there is none."""
    limit = full_reach(needs, present, first, last)  # the groups that need every block
    windows = [
        (need, have) for need, have in zip(needs, present, strict=True) if need.window_blocks is not None
    ]
    for n in range(limit, first, -1):
        if all(all(have[i - first] for i in need.needed(first, n)) for need, have in windows):
            return n
    return first


def full_reach(needs: Sequence[GroupNeed], present: Sequence[Sequence[bool]], first: int, last: int) -> int:
    """The longest prefix the full-attention groups alone allow (``last`` when there is none):
    where a prompt parts from what was stored, a point a later hit may land on."""
    limit = last
    for need, have in zip(needs, present, strict=True):
        if need.window_blocks is None:
            run = 0
            while first + run < limit and have[run]:
                run += 1
            limit = first + run
    return limit


def window_blocks_to_save(need: GroupNeed, points: Iterable[int], done: set[int], end: int) -> list[int]:
    """The blocks a sliding-window group saves for hits at ``points`` (lengths in blocks, at
    most ``end``, the blocks computed): the window before each, below ``end``, not in ``done``
    (saved or planned already), in order. ``done`` gets them."""
    out: set[int] = set()
    for p in points:
        if 0 < p <= end:
            out.update(i for i in need.needed(0, p) if i not in done)
    done.update(out)
    return sorted(out)
