"""Benchmarks (``hpkv bench ...``) and the statistics they share."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def order_balanced(ratios: Sequence[float]) -> float:
    """One ratio from pairs run in alternating order (every other pair ran its other half
    first): the mean of each order's median, so that whatever runs second being faster (a
    warmer cache, a disk that speeds up) is not taken for either side's doing."""
    return statistics.mean(statistics.median(ratios[first::2]) for first in (0, 1) if ratios[first::2])
