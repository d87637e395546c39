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
"""

from __future__ import annotations

import time
from collections import deque

from hpkv.protocol.wire import Tier

MIN_PREFILL_TOKENS = 256  # steps with fewer computed tokens say little about the prefill rate
EWMA = 0.3  # weight of the newest measurement


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
            load_s += self.load[Tier(tier)].seconds(block_size)
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
