"""Does hpkv stall the other requests? One client streams a long generation; meanwhile
another request gets an 8192-token storage hit, then the same prompt as a DRAM hit (loaded in
the step and as ``HPKV_ASYNC_DRAM_LOADS`` has it, two rounds each), or another prompt's
write-through runs. The streaming client's inter-token gaps (p50 and max) are compared with
its gaps alone, measured in the same run on the same server (part of ``hpkv bench ttft
--interference``).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

STREAM_PROMPT_TOKENS = 64
STREAM_TOKENS = 160
#: The hit cases after the storage hit, their order turned round each round (ABC CBA ABC CBA:
#: a drift of the shared machine's speed moves all alike). ``dram_hit_in_step`` asks for the
#: load inside the step (kv_transfer_params hpkv_async_dram_load false: how every DRAM hit
#: loaded before HPKV_ASYNC_DRAM_LOADS); ``dram_hit_configured`` sets nothing: the engine's
#: HPKV_ASYNC_DRAM_LOADS decides; ``gpu_hit``, the same prompt from vLLM's own prefix cache,
#: is the floor: what admitting an 8192-token prompt costs the others without any load.
IN_STEP = {"kv_transfer_params": {"hpkv_async_dram_load": False}}
BACKGROUND = {"kv_transfer_params": {"hpkv_async_dram_load": True}}
DRAM_CASES = {"dram_hit_in_step": IN_STEP, "dram_hit_configured": None, "gpu_hit": None}
KEEP_CACHE = frozenset({"gpu_hit"})  # no reset of the engine's cache before these
DRAM_ROUNDS = 4
#: With no stream: what a background load costs a DRAM hit that nobody else waits for (why
#: HPKV_ASYNC_DRAM_LOADS=auto loads in the step then). Same rounds and order.
ALONE_CASES = {"in_step": IN_STEP, "background": BACKGROUND}


def stream_chunks(url: str, body: dict[str, Any], timeout: float = 600.0) -> Iterator[dict[str, Any]]:
    """The decoded chunks of one streamed ``/v1/completions`` call (``body`` with ``stream``),
    as they arrive; RuntimeError naming the status when vLLM refuses it."""
    import requests

    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed with HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[6:])


def stream_token_times(
    url: str, model: str, prompt: str, max_tokens: int, times: list[float] | None = None
) -> list[float]:
    """Arrival times (perf_counter) of each streamed token of one greedy completion, appended
    to ``times`` as they arrive (another thread may watch it)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = [] if times is None else times
    for chunk in stream_chunks(url, body):
        if chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    return times


def gap_stats(
    times: list[float], window: tuple[float, float] | None = None, starting_inside: bool = False
) -> dict[str, float]:
    """p50 and max of the gaps between consecutive tokens (ms), over the gaps that end inside
    ``window`` (perf_counter seconds) if given, or with ``starting_inside`` over those that
    start inside it (a gap that was already running when the window opened is not its doing)."""

    return _stats(gaps_ms(times, window, starting_inside))


def gaps_ms(
    times: list[float], window: tuple[float, float] | None = None, starting_inside: bool = False
) -> list[float]:
    """The gaps :func:`gap_stats` counts, in ms."""

    def counts(a: float, b: float) -> bool:
        if window is None:
            return True
        if starting_inside:
            return window[0] <= a <= window[1]
        return window[0] <= b <= window[1] + (b - a)

    return [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False) if counts(a, b)]


def _stats(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"p50_ms": 0.0, "max_ms": 0.0, "gaps": 0}
    return {"p50_ms": round(statistics.median(gaps), 1), "max_ms": round(max(gaps), 1), "gaps": len(gaps)}


def while_streaming(
    url: str,
    model: str,
    stream_prompt: str,
    other: Callable[[], tuple[float, float]],
    starting_inside: bool = False,
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
    return {
        **gap_stats(times, window, starting_inside),
        "window_s": round(window[1] - window[0], 3),
        # tokens streamed before the window opened and in all (a window with no gap had none after it)
        "stream_tokens": [sum(1 for x in times if x < window[0]), len(times)],
        "_times": times,
        "_window": window,
    }


def merged(rounds: list[dict]) -> dict[str, Any]:
    """One case's gap statistics over all its rounds' windows (the rounds' raw times dropped)."""
    out: dict[str, Any] = _stats([g for r in rounds for g in gaps_ms(r["_times"], r["_window"])])
    out["max_ms_per_round"] = [r["max_ms"] for r in rounds]
    out["window_s"] = [r["window_s"] for r in rounds]
    out["stream_tokens"] = [r["stream_tokens"] for r in rounds]
    return out


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_")}


def _rounds(
    cases: Mapping[str, dict[str, Any] | None],
    reset_engine_cache: Callable[[], None],
    run: Callable[[str, dict[str, Any] | None], Any],
) -> dict[str, list[Any]]:
    """``run(case, extra)`` of every case, :data:`DRAM_ROUNDS` times, their order turned round
    each round, each after ``reset_engine_cache()`` (but those in :data:`KEEP_CACHE`): each
    case's results."""
    out: dict[str, list[Any]] = {case: [] for case in cases}
    for i in range(DRAM_ROUNDS):
        for case in list(cases) if i % 2 == 0 else list(cases)[::-1]:
            if case not in KEEP_CACHE:
                reset_engine_cache()
            out[case].append(run(case, cases[case]))
    return out


def measure(
    url: str,
    model: str,
    hit_prompt: str,
    cold_prompt: str,
    spills_pending: Callable[[], int],
    ttft: Callable[[str, dict[str, Any] | None], float],
    reset_engine_cache: Callable[[], None],
    loads: Callable[[], dict[str, int]],
) -> dict[str, Any]:
    """Gaps alone, during a storage hit of ``hit_prompt`` (which hpkv holds on storage only),
    during DRAM hits and GPU hits of it (:data:`DRAM_CASES`), and
    during the write-through of ``cold_prompt``. ``ttft(prompt, extra)`` sends one request (its
    body with ``extra``) and returns its time to first byte; ``loads()`` gives hpkv's served
    tokens per tier (each hit's are reported); ``spills_pending()`` must be cheap (it is
    polled every 20 ms while the client streams).

    The cold prompt is sent while the client streams, and its window opens at its first byte:
    its prefill is the engine's compute, not hpkv's, and hpkv writes through as the prefill
    runs, so only what is left at the first byte overlaps the window. If nothing is left, the
    write-through kept pace with the prefill and there is nothing to measure."""
    stream_prompt = "W " * STREAM_PROMPT_TOKENS
    alone = stream_token_times(url, model, stream_prompt, STREAM_TOKENS)
    out: dict[str, Any] = {"alone": gap_stats(alone[4:])}

    def hit(key: str, extra: dict[str, Any] | None = None) -> Callable[[], tuple[float, float]]:
        # Read before the stream starts: loads() runs `hpkv status` (a second or more on a busy
        # machine), which must neither delay the hit past the stream's first tokens nor disturb them.
        before = loads()

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            out.setdefault(f"{key}_ttft_s", []).append(round(ttft(hit_prompt, extra), 3))
            t1 = time.perf_counter()
            after = loads()
            out.setdefault(f"{key}_served", []).append({t: after[t] - before[t] for t in after})
            return t0, t1

        return run

    out["during_storage_hit"] = _public(while_streaming(url, model, stream_prompt, hit("storage_hit")))
    out["storage_hit_ttft_s"] = out["storage_hit_ttft_s"][0]
    # The prompt is now in hpkv's DRAM (the storage hit promoted it): each case resets the engine's cache.
    for case, rs in _rounds(
        DRAM_CASES,
        reset_engine_cache,
        lambda case, extra: while_streaming(url, model, stream_prompt, hit(case, extra)),
    ).items():
        out[f"during_{case}"] = merged(rs)
    out["dram_hit_alone_ttft_s"] = _rounds(
        ALONE_CASES, reset_engine_cache, lambda case, extra: round(ttft(hit_prompt, extra), 3)
    )

    tail: dict[str, Any] = {}

    def write_through() -> tuple[float, float]:
        tail["cold_ttft_s"] = round(ttft(cold_prompt, None), 3)
        t0 = time.perf_counter()
        tail["spills_left_at_first_byte"] = pending = spills_pending()
        while pending > 0 and time.perf_counter() - t0 < 120:
            time.sleep(0.02)
            pending = spills_pending()
        return t0, time.perf_counter()

    during = _public(while_streaming(url, model, stream_prompt, write_through, starting_inside=True))
    if during["gaps"]:
        out["during_write_through"] = {**during, **tail}
    else:
        left = tail["spills_left_at_first_byte"]
        why = (
            f"{left} spills were left at the cold prompt's first byte, done within {during['window_s']} s "
            "(less than one token)"
            if left
            else "nothing was left to write at the cold prompt's first byte"
        )
        out["during_write_through"] = {
            "skipped": f"the write-through kept pace with the prefill: {why}",
            **tail,
        }
    base = out["alone"]["max_ms"] or 1.0
    for k in ("during_storage_hit", *(f"during_{c}" for c in DRAM_CASES), "during_write_through"):
        if "max_ms" in out[k]:
            out[k]["max_vs_alone_max"] = round(out[k]["max_ms"] / base, 2)
    return out
