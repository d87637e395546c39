"""The scheduler side of the connector (EngineCore process): bookkeeping only, no copies.

It looks prefixes up in hpkv, pins hits, reserves pool slots for newly full blocks and
tells the workers what to copy through the step's metadata. It talks to hpkv only through
:class:`~hpkv.client.contract.KvStore`, so it is unit-tested against an in-memory store.
Any hpkv failure means fewer hits or fewer saves, never a failed request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpkv.client.contract import KvStore
from hpkv.connectors.reconnect import Reconnecting
from hpkv.connectors.vllm.events import INTERVAL_S, MAX_BLOCKS, EventFeed, EventTranslator
from hpkv.connectors.vllm.groups import full_reach, longest_hit, window_blocks_to_save
from hpkv.connectors.vllm.layout import Layout
from hpkv.connectors.vllm.metadata import NULL_BLOCK_ID, HpkvMetadata, LoadOp, SaveOp
from hpkv.connectors.vllm.worth import REPORT_EVERY_S, LoadPolicy, Report, TimeSaved
from hpkv.protocol.errors import ROW_MISSING, HpkvUnavailable
from hpkv.protocol.keys import block_keys
from hpkv.protocol.wire import MAX_KEYS_PER_CALL, Tier

log = logging.getLogger("vllm.hpkv")

#: ``kv_transfer_params`` key of a request that hpkv leaves alone: nothing is looked up or loaded
#: for it, nothing of it is saved (a prompt that must not reach the pool or the disk; the
#: benchmark's baseline). vLLM takes it in the request body: ``"kv_transfer_params":
#: {"hpkv_skip": true}``.
SKIP_PARAM = "hpkv_skip"

#: ``kv_transfer_params`` key of a request that chooses how its DRAM-only hit loads: true in the
#: background, false in the step, whatever ``HPKV_ASYNC_DRAM_LOADS`` says (unless that is 0).
#: The benchmark measures both ways on one engine with it.
ASYNC_DRAM_PARAM = "hpkv_async_dram_load"


def skipped(request: Any) -> bool:
    """Whether the request asked hpkv to leave it alone (:data:`SKIP_PARAM`)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get(SKIP_PARAM) is True  # JSON true, not "false"


def asked_async_dram(request: Any) -> bool | None:
    """The request's :data:`ASYNC_DRAM_PARAM` (a JSON boolean), None if it sets none."""
    params = getattr(request, "kv_transfer_params", None)
    value = params.get(ASYNC_DRAM_PARAM) if isinstance(params, dict) else None
    return value if isinstance(value, bool) else None


@dataclass
class _Plan:
    """A hit found by a lookup, for the allocation that follows: blocks ``[first, first + n)``,
    each group's keys and tiers over that range (``keys[g][i - first]``)."""

    first: int
    n: int
    keys: list[list[bytes]]
    tiers: list[list[int]]
    background: bool  # loaded while the engine steps (vLLM's async load), not in the step


@dataclass
class _ReqState:
    request: Any
    skip: bool = False  # the request asked hpkv to leave it alone
    saved_upto: int = 0  # blocks [0, saved_upto) need no save (sliding-window groups: see below)
    # Sliding-window groups: lengths (blocks) a later hit may land on, whose windows are saved
    # once computed, and per group the blocks saved or planned (:mod:`.groups`).
    points: set[int] = field(default_factory=set)
    points_reached: set[int] = field(default_factory=set)
    window_done: dict[int, set[int]] = field(default_factory=dict)
    plan: _Plan | None = None
    pinned: list[bytes] = field(default_factory=list)
    unconfirmed_since: float | None = None  # its lookups end at a block still being checked


class SchedulerSide:
    """``open_store`` connects and attaches the namespace: (store, namespace id).
    ``block_ids_of(req_id)`` gives a request's KV cache block ids, one list per KV cache group
    (None before vLLM binds its KV cache manager).

    A hybrid model (several KV cache groups, :mod:`.groups`) saves each group's blocks under
    its own keys and loads each group what a hit needs from it. Its loads all run in the
    background (vLLM's async load): vLLM recomputes a failed load of such a model only as a
    failed request (``failed_recving``), never by block ids, which are per group.

    ``background_dram_loads`` (``HPKV_ASYNC_DRAM_LOADS``): whether a DRAM-only hit loads in the
    background too; None (auto): while other requests are running, which would otherwise wait
    for its copy in the step (:meth:`loads_in_background`)."""

    def __init__(
        self,
        layout: Layout,
        threshold: int | None,
        open_store: Callable[[], tuple[KvStore, int]],
        block_ids_of: Callable[[str], Sequence[Sequence[int]] | None],
        background_storage_loads: bool = True,
        lookup_retry_s: float = 1.0,
        report_every_s: float | None = REPORT_EVERY_S,
        background_dram_loads: bool | None = None,
    ):
        self.layout = layout
        self.block_size = layout.block_size
        self.policy = LoadPolicy(threshold)  # threshold None: VLLM_HPKV_TOKEN_THRESHOLD=auto
        self.background_storage_loads = background_storage_loads
        self.background_all_loads = len(layout.groups) > 1
        self.windowed = any(g.window_blocks is not None for g in layout.groups)
        self.stateful = any(g.state for g in layout.groups)  # SSM/linear-attention state groups
        self.background_dram_loads = background_dram_loads  # None: auto
        self.lookup_retry_s = lookup_retry_s  # HPKV_STORAGE_LOOKUP_RETRY_MS
        self.ns_id = -1
        self._open_store = open_store
        self._block_ids_of = block_ids_of
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadOp] = []
        self._hit_tiers: dict[str, tuple[int, int]] = {}  # req -> (dram tokens, storage tokens)
        self._running: set[str] = set()  # scheduled in the latest step and not finished since
        self.hpkv: Reconnecting[KvStore] = Reconnecting("scheduler", self._connect, log)
        # The prefill time the loads saved, reported to the server (`hpkv status`, hpkv-top, metrics).
        self.time_saved = TimeSaved(
            layout.world_size, self.policy.prefill, self._send_time_saved, report_every_s
        )
        # KV events (vLLM's --kv-events-config): None unless enabled, then nothing is recorded.
        self.events: EventTranslator | None = None
        self.feed: EventFeed | None = None
        self._kv_events: list[Any] = []  # translated, for the next take_events

    def enable_kv_events(self, interval_s: float = INTERVAL_S, max_blocks: int = MAX_BLOCKS) -> None:
        """Publish hpkv's tier changes of the blocks this engine saves or loads (:mod:`.events`)."""
        self.events = EventTranslator(self.block_size, max_blocks)
        self.feed = EventFeed(lambda: self.hpkv.client, lambda: self.ns_id, interval_s)
        self.feed.start()

    def take_events(self) -> list[Any]:
        """vLLM KV events since the last call (every scheduler step)."""
        if self.events is None or self.feed is None:
            return []
        try:
            records = self.feed.take()
            if records:
                self._kv_events += self.events.translate(records)
        except Exception as exc:  # noqa: BLE001 - events are a courtesy to routers: never break a step
            self._events_broke(exc)
        out, self._kv_events = self._kv_events, []
        return out

    def _remember(self, request: Any, keys: list[bytes], where: Sequence[tuple[int, ...]]) -> None:
        """The blocks a request saves or loads, for its KV events; ``where``: (block, group[, tier])."""
        if self.events is None:
            return
        try:
            self.events.remember(request, keys, [w[0] for w in where], [w[1] for w in where])
            if where and len(where[0]) > 2:  # a hit: news to a router that missed the save (a restart)
                self._kv_events += self.events.translate(
                    [(k, w[2]) for k, w in zip(keys, where, strict=True)]
                )
        except Exception as exc:  # noqa: BLE001 - events are a courtesy to routers: never break a step
            self._events_broke(exc)

    def _events_broke(self, exc: BaseException) -> None:
        log.warning(
            "hpkv: KV events stopped (%s: %s); serving goes on", type(exc).__name__, exc, exc_info=True
        )
        if self.feed is not None:
            self.feed.close()
        self.events = self.feed = None
        self._kv_events = []

    def _connect(self) -> KvStore:
        store, self.ns_id = self._open_store()
        return store

    def _keys(self, hashes: Sequence[bytes], group: int = 0) -> list[bytes]:
        return block_keys(self.layout.fingerprint, list(hashes), group)

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        return st if st is not None else self._new_state(request)

    def _new_state(self, request: Any) -> _ReqState:
        st = self._reqs[request.request_id] = _ReqState(request, skip=skipped(request))
        return st

    def on_new_request(self, request: Any) -> None:
        self._new_state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens hpkv can load, whether they load in the background); (None, False) while
        the block after the hit is still being checked on storage: vLLM asks again on a
        later step (at most HPKV_STORAGE_LOOKUP_RETRY_MS), the other requests run meanwhile."""
        st = self._state(request)
        st.plan = None
        if st.skip:
            return 0, False
        client = self.hpkv.get()
        if client is None:
            return 0, False
        first = num_computed_tokens // self.block_size
        if self.windowed and first > 0:
            st.points.add(first)  # the engine's own hit: this prompt shares it with another
        # A synchronous hit must leave at least one token to compute.
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if last <= first:
            return 0, False
        groups = self.layout.groups
        width = len(groups)
        last = min(last, first + MAX_KEYS_PER_CALL // width)  # one call: beyond it, recomputed
        hashes = request.block_hashes[first:last]
        keys = [self._keys(hashes, g) for g in range(width)]
        span = last - first
        try:
            if self.windowed:
                # A sliding-window group stores windows, not every block: one lookup answers
                # every key, group by group (a run of storage hits is checked at once), the
                # full-attention groups first (their prefix is looked for on storage as any).
                order = sorted(range(width), key=lambda g: groups[g].window_blocks is not None)
                _, found, unconfirmed = client.probe_each(self.ns_id, [k for g in order for k in keys[g]])
                at = {g: j * span for j, g in enumerate(order)}
                tiers = [found[at[g] : at[g] + span] for g in range(width)]
            else:
                # One lookup for all groups, block by block with every group's key: the prefix
                # it answers says which blocks each group has.
                probe_keys = (
                    keys[0] if width == 1 else [k for block in zip(*keys, strict=True) for k in block]
                )
                hit, found, unconfirmed = client.probe(self.ns_id, probe_keys)
                tiers = [
                    [found[i * width + g] if i * width + g < hit else 0 for i in range(span)]
                    for g in range(width)
                ]
        except Exception as exc:  # noqa: BLE001 - hpkv trouble means recompute
            self.hpkv.lost(exc)
            return 0, False
        if unconfirmed and self._wait_for_checks(st):
            return None, False
        st.unconfirmed_since = None
        present = [[t != 0 for t in row] for row in tiers]
        if self.windowed:
            # Where this prompt parts from a stored one whose windows end elsewhere: saved
            # there, the next prompt sharing this prefix hits it.
            st.points.add(full_reach(groups, present, first, last))
        end = last
        while True:
            n = longest_hit(groups, present, first, end)
            block_tiers = self._block_tiers(tiers, first, n)
            load = self.policy.blocks_to_load(block_tiers, self.block_size) if n > first else 0
            if load == 0:
                return 0, False
            if first + load >= n:
                break
            end = first + load  # the policy loads less: the groups' needs at that length
        background = self.loads_in_background(request, block_tiers)
        st.plan = _Plan(
            first,
            n - first,
            [row[: n - first] for row in keys],
            [row[: n - first] for row in tiers],
            background,
        )
        return (n - first) * self.block_size, background

    def loads_in_background(self, request: Any, block_tiers: list[int]) -> bool:
        """Whether a hit (the tier of each block) loads in the background (vLLM's async load:
        the request waits, the others keep stepping) rather than in the step, where every
        running request waits for its copy.

        A hit that needs the disk: in the background (``HPKV_ASYNC_STORAGE_LOADS``). A
        DRAM-only hit (``HPKV_ASYNC_DRAM_LOADS``, or the request's :data:`ASYNC_DRAM_PARAM`
        unless that key is 0): auto loads it in the background while other requests run (an
        8192-token hit of a 7B model copies 448 MiB, tens of ms on a CPU: every running
        request's next token would wait for it), and in the step when none runs (nobody
        waits, and the hit saves the step an async load takes to be reported)."""
        if self.background_all_loads:
            return True
        if max(block_tiers, default=0) >= Tier.STORAGE:  # files or the remote store
            return self.background_storage_loads
        if self.background_dram_loads is False:
            return False
        asked = asked_async_dram(request)
        if asked is not None:
            return asked
        if self.background_dram_loads is None:
            return bool(self._running - {request.request_id})
        return True

    def _block_tiers(self, tiers: list[list[int]], first: int, n: int) -> list[int]:
        """The slowest tier each block of ``[first, n)`` loads from, over the groups that need it."""
        out = [int(Tier.DRAM)] * (n - first)
        for need, row in zip(self.layout.groups, tiers, strict=True):
            for i in need.needed(first, n):
                out[i - first] = max(out[i - first], row[i - first])
        return out

    def _wait_for_checks(self, st: _ReqState) -> bool:
        """Whether the request may wait another step for its storage checks."""
        now = time.monotonic()
        if st.unconfirmed_since is None:
            st.unconfirmed_since = now
        if now - st.unconfirmed_since < self.lookup_retry_s:
            return True
        log.info(
            "request %s: its next block was still being checked on storage after %.0f ms "
            "(HPKV_STORAGE_LOOKUP_RETRY_MS): the rest of its prefix is recomputed",
            st.request.request_id,
            (now - st.unconfirmed_since) * 1000,
        )
        return False

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """``block_ids``: the request's KV cache blocks, one list per KV cache group."""
        st = self._state(request)
        plan, st.plan = st.plan, None
        if num_external_tokens == 0 or plan is None:
            return
        first = plan.first
        n = min(plan.n, num_external_tokens // self.block_size)
        keys: list[bytes] = []
        targets: list[int] = []
        where: list[tuple[int, int, int]] = []  # (block, group, tier) of each key, for KV events
        for g, need in enumerate(self.layout.groups):
            for i in need.needed(first, first + n):
                block = block_ids[g][i]
                # A window's null block: outside vLLM's window, nothing to load. A state group's
                # is kept: vLLM allocates the hit's state block there, so a null one fails the
                # load (the worker's) and the request is recomputed, never run from no state.
                if need.window_blocks is None or need.state or block != NULL_BLOCK_ID:
                    keys.append(plan.keys[g][i - first])
                    targets.append(block)
                    where.append((i, g, plan.tiers[g][i - first]))
                    if need.window_blocks is not None:
                        st.window_done.setdefault(g, set()).add(i)  # stored: not saved again
        self._remember(request, keys, where)
        tiers = self._block_tiers(plan.tiers, first, first + n)
        client = self.hpkv.get()
        offsets = np.full((len(keys), self.layout.world_size), ROW_MISSING, np.int64)
        if client is not None:
            try:
                offsets = client.pin(self.ns_id, keys)
                st.pinned.extend(keys)
            except Exception as exc:  # noqa: BLE001 - the worker reports the blocks failed
                self.hpkv.lost(exc)
        tokens = n * self.block_size if len(self.layout.groups) > 1 else None
        # As promised to vLLM by get_num_new_matched_tokens: a request it holds waiting for a
        # background load that the worker then loads in the step would wait forever.
        self._pending_loads.append(
            LoadOp(request.request_id, keys, targets, offsets, plan.background, tokens)
        )
        dram = sum(1 for t in tiers if t == Tier.DRAM) * self.block_size
        self._hit_tiers[request.request_id] = (dram, num_external_tokens - dram)
        st.saved_upto = max(st.saved_upto, first + n)

    def hit_tiers(self, request_id: str, num_external_tokens: int) -> tuple[int, int]:
        """(tokens from DRAM, tokens from storage) of the request's hit, once."""
        return self._hit_tiers.pop(request_id, (num_external_tokens, 0))

    def build_connector_meta(self, scheduler_output: Any) -> HpkvMetadata:
        meta = HpkvMetadata()
        self.policy.step_scheduled(sum(scheduler_output.num_scheduled_tokens.values()))
        self._running = set(scheduler_output.num_scheduled_tokens)
        meta.loads, self._pending_loads = self._pending_loads, []
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(rid)
            if st is not None:  # its blocks were freed; new ones come on resume
                st.saved_upto = 0
                st.window_done, st.points, st.points_reached = {}, st.points | st.points_reached, set()
        client = self.hpkv.get()
        if client is None:
            return meta
        computed: dict[str, int] = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        states = self._states_offered(scheduler_output) if self.stateful else {}
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in [*scheduled, *(r for r in states if r not in scheduled)]:
            st = self._reqs.get(rid)
            if st is None or st.skip:
                continue
            req = st.request
            done = computed.get(rid, req.num_computed_tokens) + scheduled.get(rid, 0)
            full = min(done // self.block_size, len(req.block_hashes))
            points = self._points_reached(st, done, full) if self.windowed else []
            offered = states.get(rid, ())
            if full <= st.saved_upto and not points and not offered:
                continue
            block_ids = self._block_ids_of(rid)
            if block_ids is None:
                return meta
            where: list[tuple[int, int]] | None = [] if self.events is not None else None
            keys, sources = self._blocks_to_save(
                req.block_hashes, block_ids, st.saved_upto, full, where, points, st.window_done
            )
            self._states_to_save(req.block_hashes, offered, st.window_done, keys, sources, where)
            full = max(full, st.saved_upto)  # a state offered after the request's last step
            if not keys:
                st.saved_upto = full
                continue
            try:
                offsets = client.reserve(self.ns_id, keys)
            except Exception as exc:  # noqa: BLE001 - hpkv trouble: fewer hits, never a failed request
                self.hpkv.lost(exc)
                return meta
            st.saved_upto = full
            rows = np.flatnonzero((offsets >= 0).all(axis=1))
            if len(rows) == 0:
                continue
            if where is not None:
                self._remember(req, [keys[i] for i in rows], [where[i] for i in rows])
            meta.saves.append(SaveOp(rid, [keys[i] for i in rows], [sources[i] for i in rows], offsets[rows]))
        return meta

    def _states_offered(self, scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM's state hand-offs of this step (``{request: [(group, block id, tokens)]}``):
        the exact blocks that hold an SSM/linear-attention group's state after ``tokens``
        tokens once the step ran (:mod:`.groups`); empty from a vLLM that offers none."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None)
        return offers if isinstance(offers, dict) else {}

    def _states_to_save(
        self,
        hashes: Sequence[bytes],
        offered: Sequence[tuple[int, int, int]],
        done: dict[int, set[int]],
        keys: list[bytes],
        sources: list[int],
        where: list[tuple[int, int]] | None,
    ) -> None:
        """Add to ``keys``/``sources`` the offered states a hit can use: a state group's state
        after ``n`` whole blocks of hashed tokens, saved under block ``n - 1``'s key (the block
        a hit of ``n`` blocks loads it into), once (``done[g]``)."""
        groups = self.layout.groups
        for g, block, tokens in offered:
            if not (0 <= g < len(groups) and groups[g].state) or block == NULL_BLOCK_ID:
                continue
            n, rest = divmod(tokens, self.block_size)
            seen = done.setdefault(g, set())
            if rest or not 0 < n <= len(hashes) or n - 1 in seen:
                continue  # a sub-block (partial-tail) state, or one past the hashed prompt
            seen.add(n - 1)
            keys.extend(self._keys([hashes[n - 1]], g))
            sources.append(block)
            if where is not None:
                where.append((n - 1, g))

    def _points_reached(self, st: _ReqState, done: int, full: int) -> list[int]:
        """The lengths a later hit may land on that ``full`` computed blocks reach (their
        sliding windows are saved now, :mod:`.groups`); ``done``: the tokens computed."""
        prompt = getattr(st.request, "num_prompt_tokens", st.request.num_tokens)
        # The prompt's end and a resend's longest hit, in the step that computes their blocks
        # (a last chunk of a few tokens may start after vLLM freed their windows); in decode,
        # each new block's end.
        st.points.update(p for p in (prompt // self.block_size, (prompt - 1) // self.block_size) if p <= full)
        if done >= prompt:
            st.points.add(full)
        points = [p for p in st.points if p <= full and p not in st.points_reached]
        st.points = {p for p in st.points if p > full}
        st.points_reached.update(points)
        return points

    def _blocks_to_save(
        self,
        hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        first: int,
        full: int,
        where: list[tuple[int, int]] | None = None,
        points: Sequence[int] = (),
        window_done: dict[int, set[int]] | None = None,
    ) -> tuple[list[bytes], list[int]]:
        """(keys, block ids) of what a later hit may need: every full-attention group's blocks
        in ``[first, full)``, each sliding-window group's window before each of ``points``
        (not in ``window_done[g]``, which gets them); ``where`` gets each key's (block index,
        group). A state group's blocks are not positional: :meth:`_states_to_save`."""
        keys: list[bytes] = []
        sources: list[int] = []
        for g, need in enumerate(self.layout.groups):
            if need.state:
                continue  # saved as vLLM hands its states over (_states_to_save), not by position
            ids = block_ids[g]
            windowed = need.window_blocks is not None
            if windowed:
                done = (window_done if window_done is not None else {}).setdefault(g, set())
                blocks = window_blocks_to_save(need, points, done, full)
            else:
                blocks = list(range(first, full))
            for i, key in zip(blocks, self._keys([hashes[i] for i in blocks], g), strict=True):
                # A sliding-window group holds no block outside its window (vLLM's null block).
                if i < len(ids) and not (windowed and ids[i] == NULL_BLOCK_ID):
                    keys.append(key)
                    sources.append(ids[i])
                    if where is not None:
                        where.append((i, g))
        return keys, sources

    def step_finished(self, stats: dict[str, float] | None) -> None:
        """A step's output arrived, with the workers' connector stats (auto threshold)."""
        self.policy.step_finished()
        if stats:
            self.policy.loads_measured(stats)
            self.time_saved.loads_measured(stats)

    def _send_time_saved(self, report: Report) -> bool:
        """Deliver a :class:`TimeSaved` report to the server (on its thread); False: not now.
        A failed connection is left to this side's own thread to drop: its next hot call
        fails too, and closing the client here could pull it from under a call."""
        client = self.hpkv.client
        if client is None:
            return False
        try:
            client.report_time_saved(self.ns_id, report)
        except HpkvUnavailable:
            return False
        except Exception as exc:  # noqa: BLE001 - refused (an older server): the figures are dropped
            log.debug("hpkv: the server refused a time-saved report: %s", exc)
        return True

    def request_finished(self, request_id: str) -> None:
        st = self._reqs.pop(request_id, None)
        self._hit_tiers.pop(request_id, None)
        self._running.discard(request_id)
        if st is None or not st.pinned:
            return
        client = self.hpkv.get()
        if client is not None:
            try:
                client.unpin(self.ns_id, st.pinned)
            except Exception as exc:  # noqa: BLE001 - hpkv trouble: fewer hits, never a failed request
                self.hpkv.lost(exc)

    def reset_cache(self) -> bool:
        """Drop this namespace from the DRAM tier (files stay); False if hpkv could not be asked."""
        client = self.hpkv.get()
        if client is None:
            return False
        try:
            dropped = client.clear(self.ns_id)
        except Exception as exc:  # noqa: BLE001 - hpkv trouble: fewer hits, never a failed request
            self.hpkv.lost(exc)
            return False
        log.info(
            "hpkv: reset_cache dropped %d blocks of namespace %s from the DRAM tier",
            dropped,
            self.layout.fingerprint[:12],
        )
        if self.events is not None and self.feed is not None:
            try:  # what happened before the reset is published before it
                self._kv_events += self.events.translate(self.feed.take())
                self._kv_events += self.events.cleared()
            except Exception as exc:  # noqa: BLE001 - events are a courtesy to routers
                self._events_broke(exc)
        return True

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.hpkv.close()
