"""``VLLM_HPKV_TOKEN_THRESHOLD=auto``: load a hit only where loading beats recomputing.

The scheduler side measures, in the engine it serves:

* the **prefill rate** (tokens/s): tokens a step computed over the time from its scheduling
  to its output, for steps that computed at least ``MIN_PREFILL_TOKENS`` (with two steps in
  flight this includes queueing: a pessimistic prefill rate, which favours loading);
* the **load rate of each tier** (tokens/s): the workers' connector stats (tokens loaded
  from DRAM and from storage, and the time each took), summed over ranks.

A hit is loaded up to the longest prefix whose load time (per tier, at its measured rate)
is below the time to recompute it; until a rate has been measured it is assumed fast (the
first loads measure it). A storage tier slower than the engine's prefill (a complaint about
other engines' file backends) is then skipped, while its DRAM prefix still loads.

The same rates say how much prefill time hpkv saved (:class:`TimeSaved`), with a fixed
threshold too: the tokens each tier loaded, what computing them would have cost at the
measured prefill rate, and what loading them cost. The server keeps the sums per namespace
and tier (``hpkv status``, hpkv-top, Prometheus).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from hpkv.protocol.wire import Tier

log = logging.getLogger("vllm.hpkv")

MIN_PREFILL_TOKENS = 256  # steps with fewer computed tokens say little about the prefill rate
EWMA = 0.3  # weight of the newest measurement
REPORT_EVERY_S = 1.0  # the time saved goes to the server at most this often (and this late)


class Rate:
    """An exponentially weighted tokens-per-second estimate (None until measured)."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None

    def add(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        r = tokens / seconds
        self.tokens_per_s = r if self.tokens_per_s is None else (1 - EWMA) * self.tokens_per_s + EWMA * r

    def seconds(self, tokens: int) -> float:
        return 0.0 if self.tokens_per_s is None else tokens / self.tokens_per_s


class LoadPolicy:
    """Decides how much of a hit to load; ``threshold`` None means auto."""

    def __init__(self, threshold: int | None, clock=time.monotonic):
        self.threshold = threshold
        self.prefill = Rate()
        self.load = {Tier.DRAM: Rate(), Tier.STORAGE: Rate()}
        self._clock = clock
        self._in_flight: deque[tuple[float, int]] = deque(maxlen=8)  # (scheduled at, tokens)

    @property
    def auto(self) -> bool:
        return self.threshold is None

    # ---------------------------------------------------------------- measurements
    def step_scheduled(self, computed_tokens: int) -> None:
        """A step was scheduled that computes ``computed_tokens``."""
        self._in_flight.append((self._clock(), computed_tokens))

    def step_finished(self) -> None:
        """The output of the oldest step in flight arrived."""
        if self._in_flight:
            t0, tokens = self._in_flight.popleft()
            if tokens >= MIN_PREFILL_TOKENS:
                self.prefill.add(tokens, self._clock() - t0)

    def loads_measured(self, stats: dict[str, float]) -> None:
        """The workers' connector stats of a step (summed over ranks)."""
        self.load[Tier.DRAM].add(stats.get("loaded_tokens_dram", 0), stats.get("load_time_dram_s", 0.0))
        self.load[Tier.STORAGE].add(
            stats.get("loaded_tokens_storage", 0), stats.get("load_time_storage_s", 0.0)
        )

    # ---------------------------------------------------------------- decision
    def blocks_to_load(self, tiers: list[int], block_size: int) -> int:
        """How many leading blocks of a hit (their tiers in order) to load: with a fixed
        threshold all or none; in auto mode the prefix that saves the most time (load it,
        recompute the rest), all of it while a rate is still unmeasured."""
        n = len(tiers)
        if not self.auto:
            return n if n * block_size >= (self.threshold or 0) else 0
        if self.prefill.tokens_per_s is None:
            return n
        best, best_gain, load_s = 0, 0.0, 0.0
        for i, tier in enumerate(tiers, 1):
            # (a remote block loads at the rate measured for loads from below the pool)
            load_s += self.load[Tier(min(tier, Tier.STORAGE))].seconds(block_size)
            gain = self.prefill.seconds(i * block_size) - load_s
            if gain >= best_gain:
                best, best_gain = i, gain
        return best

    def describe(self) -> str:
        def fmt(r: Rate) -> str:
            return "unmeasured" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f} tok/s"

        return (
            f"prefill {fmt(self.prefill)}, DRAM load {fmt(self.load[Tier.DRAM])}, "
            f"storage load {fmt(self.load[Tier.STORAGE])}"
        )


#: Per tier (as the server names it): the workers' stats of its loaded tokens and their time.
_LOAD_STATS = (
    ("dram", "loaded_tokens_dram", "load_time_dram_s"),
    ("storage", "loaded_tokens_storage", "load_time_storage_s"),
)

#: ``{tier: (tokens, prefill µs saved, load µs)}``: one report to the server.
Report = dict[str, tuple[int, int, int]]


class TimeSaved:
    """The prefill time this engine's loads saved, per tier, until the server has it.

    From each step's worker stats (summed over ranks: divided by the world size): the tokens
    each tier loaded and the time the loads took (a load that needed storage counts its whole
    time, DRAM blocks included, against storage, as the load rates do). The prefill those
    tokens would have cost is their count at the engine's measured prefill rate, the rate the
    auto threshold uses: a step's tokens over its time, so a pessimistic one when steps
    overlap (the saving is then overstated). Loads made before any prefill was measured (an
    engine restarted onto stored blocks) wait for the rate.

    ``send`` delivers a report (False: not now, it is kept); a daemon thread calls it at most
    every ``every_s`` while something is due, off the scheduler's thread. Nothing here grows:
    a few numbers per tier."""

    def __init__(
        self,
        world_size: int,
        prefill: Rate,
        send: Callable[[Report], bool],
        every_s: float | None = REPORT_EVERY_S,
    ):
        self._world = max(1, world_size)
        self._prefill = prefill
        self._send = send
        self._every = every_s  # None: no thread, the owner calls report()
        self._lock = threading.Lock()
        self._unrated = {tier: [0.0, 0.0] for tier, _, _ in _LOAD_STATS}  # tokens, load s
        self._due = self._empty()  # tokens, prefill s, load s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @staticmethod
    def _empty() -> dict[str, list[float]]:
        return {tier: [0.0, 0.0, 0.0] for tier, _, _ in _LOAD_STATS}

    def loads_measured(self, stats: dict[str, float]) -> None:
        """The workers' connector stats of a step (summed over ranks)."""
        loaded = False
        with self._lock:
            for tier, tokens_key, time_key in _LOAD_STATS:
                tokens = stats.get(tokens_key, 0) / self._world
                if tokens > 0:
                    u = self._unrated[tier]
                    u[0] += tokens
                    u[1] += stats.get(time_key, 0.0) / self._world
                    loaded = True
            if loaded:
                self._rate()
        if loaded and self._every is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpkv-time-saved", daemon=True)
            self._thread.start()

    def _rate(self) -> None:
        """Under the lock: the unrated loads become due once the prefill rate is known."""
        rate = self._prefill.tokens_per_s
        if rate is None:
            return
        for tier, (tokens, load_s) in self._unrated.items():
            if tokens:
                d = self._due[tier]
                d[0] += tokens
                d[1] += tokens / rate
                d[2] += load_s
                self._unrated[tier] = [0.0, 0.0]

    def report(self) -> bool:
        """Send what is due; False when ``send`` could not (it stays due)."""
        with self._lock:
            self._rate()
            due, self._due = self._due, self._empty()
        report = {
            tier: (round(tokens), round(prefill_s * 1e6), round(load_s * 1e6))
            for tier, (tokens, prefill_s, load_s) in due.items()
            if tokens >= 0.5
        }
        if not report or self._send(report):
            return True
        with self._lock:  # kept for the next report
            for tier, values in due.items():
                self._due[tier] = [a + b for a, b in zip(self._due[tier], values, strict=True)]
        return False

    def _run(self) -> None:
        assert self._every is not None
        while not self._stop.wait(self._every):
            try:
                self.report()
            except Exception:  # noqa: BLE001 - a lost report must not end the reports
                log.debug("hpkv: time-saved report failed", exc_info=True)

    def close(self) -> None:
        """Stop the reports (what is still due is not sent)."""
        self._stop.set()
