"""Does hpkv stall the other requests? One client streams a long generation; meanwhile
another request gets an 8192-token storage hit, or another prompt's write-through runs.
The streaming client's inter-token gaps (p50 and max) are compared with its gaps alone,
measured in the same run on the same server (part of ``hpkv bench ttft --interference``).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

STREAM_PROMPT_TOKENS = 64
STREAM_TOKENS = 160


def stream_token_times(
    url: str, model: str, prompt: str, max_tokens: int, times: list[float] | None = None
) -> list[float]:
    """Arrival times (perf_counter) of each streamed token of one greedy completion, appended
    to ``times`` as they arrive (another thread may watch it)."""
    import requests

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = [] if times is None else times
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if (
                line.startswith(b"data: ")
                and line != b"data: [DONE]"
                and json.loads(line[6:])["choices"][0].get("text")
            ):
                times.append(time.perf_counter())
    return times


def gap_stats(times: list[float], window: tuple[float, float] | None = None) -> dict[str, float]:
    """p50 and max of the gaps between consecutive tokens (ms), over the gaps that end inside
    ``window`` (perf_counter seconds) if given."""
    gaps = [
        (b - a) * 1000
        for a, b in zip(times, times[1:], strict=False)
        if window is None or window[0] <= b <= window[1] + (b - a)
    ]
    if not gaps:
        return {"p50_ms": 0.0, "max_ms": 0.0, "gaps": 0}
    return {"p50_ms": round(statistics.median(gaps), 1), "max_ms": round(max(gaps), 1), "gaps": len(gaps)}


def while_streaming(
    url: str, model: str, stream_prompt: str, other: Callable[[], tuple[float, float]]
) -> dict:
    """Stream ``STREAM_TOKENS`` tokens; once the stream runs, call ``other`` (which returns the
    perf_counter window its disturbance lasted); the gap statistics over that window."""
    times: list[float] = []
    t = threading.Thread(
        target=stream_token_times, args=(url, model, stream_prompt, STREAM_TOKENS, times), daemon=True
    )
    t.start()
    deadline = time.monotonic() + 120
    while len(times) < 8 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # the stream is in its decode phase
    window = other()
    t.join(600)
    return {**gap_stats(times, window), "window_s": round(window[1] - window[0], 3)}


def measure(
    url: str,
    model: str,
    hit_prompt: str,
    cold_prompt: str,
    spills_pending: Callable[[], int],
    ttft: Callable[[str], float],
) -> dict[str, Any]:
    """Gaps alone, during a storage hit of ``hit_prompt``, and during the write-through of
    ``cold_prompt`` (computed first; only the spills overlap the stream). ``ttft(prompt)``
    sends one request and returns its time to first byte."""
    stream_prompt = "W " * STREAM_PROMPT_TOKENS
    alone = stream_token_times(url, model, stream_prompt, STREAM_TOKENS)
    out: dict[str, Any] = {"alone": gap_stats(alone[4:])}

    def storage_hit() -> tuple[float, float]:
        t0 = time.perf_counter()
        out["storage_hit_ttft_s"] = round(ttft(hit_prompt), 3)
        return t0, time.perf_counter()

    out["during_storage_hit"] = while_streaming(url, model, stream_prompt, storage_hit)

    ttft(cold_prompt)  # its prefill is compute, not hpkv: done before the stream starts

    def write_through() -> tuple[float, float]:
        t0 = time.perf_counter()
        while spills_pending() > 0 and time.perf_counter() - t0 < 120:
            time.sleep(0.02)
        return t0, time.perf_counter()

    if spills_pending() > 0:
        out["during_write_through"] = while_streaming(url, model, stream_prompt, write_through)
    else:
        out["during_write_through"] = {"skipped": "the write-through had ended before the stream started"}
    base = out["alone"]["max_ms"] or 1.0
    for k in ("during_storage_hit", "during_write_through"):
        if "max_ms" in out[k]:
            out[k]["max_vs_alone_max"] = round(out[k]["max_ms"] / base, 2)
    return out
