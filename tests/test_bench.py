"""The benchmarks' own arithmetic: the seed's exact prompt, bytes per token of a model, the
floors, and how hpkv's added time is set against them (no vLLM needed)."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest

from hpkv.bench import ttft
from hpkv.bench.floors import memcpy_gbps, raw_read_gbps


def test_the_prompt_is_the_seeds_bytes_with_the_trailing_space():
    # printf "A %.0s" $(seq 1 3)
    assert ttft.prompt_for("A", 3) == "A A A "


@pytest.mark.parametrize(
    ("shape", "per_token"), [("tiny", 4 * 1024), ("qwen2.5-7b", 56 * 1024)], ids=["tiny", "qwen2.5-7b"]
)
def test_bytes_per_token_of_the_generated_shapes(tmp_path, shape, per_token):
    # The config generate_model writes for each shape, without generating weights.
    spec = {"hidden_size": 512, "num_layers": 8, "num_attention_heads": 8, "num_kv_heads": 2}
    spec.update(ttft.SHAPES[shape])
    config = {
        "hidden_size": spec["hidden_size"],
        "num_hidden_layers": spec["num_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_kv_heads"],
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ttft.kv_bytes_per_token(str(tmp_path)) == per_token


@pytest.mark.parametrize(
    ("shape", "full", "other"),
    [("gemma3", 5, 29), ("gpt-oss-20b", 12, 12), ("qwen3-next", 12, 36)],
    ids=["gemma3", "gpt-oss-20b", "qwen3-next"],
)
def test_the_hybrid_shapes_have_their_models_layer_mix(shape, full, other):
    from hpkv.testing.model import ModelSpec

    spec = ModelSpec(**ttft.SHAPES[shape])
    spec.validate()
    kinds = spec.layer_types
    assert (kinds.count("full_attention"), len(kinds) - kinds.count("full_attention")) == (full, other)


def test_added_time_is_set_against_the_floor_for_the_bytes_loaded():
    res = {
        "ttft": {"cold_no_hpkv": [10.0], "cold": [10.2], "gpu_hit": [0.1], "dram_hit": [0.15]},
        "served_tokens": {"dram_hit": {"dram": 8192, "storage": 0}},
        "requests": 1,
        "tokens": 8192,
        "model": "m",
        "kv_bytes_per_token": 56 * 1024,
        "dram_floor_gbps": {"threads_1": 10.0, "threads_2": 15.0, "best": 15.0},
        "cpu_s_per_request": {"cold": {"engine": 12.5, "hpkv": 0.25}},
    }
    s = ttft.summarize(res)
    assert s["cold_hpkv_cpu_vs_engine"] == pytest.approx(0.02)
    assert s["dram_added_ms"] == pytest.approx(50.0)
    # No CPU figures for the hit phases: the floor is the best memcpy of all.
    assert s["dram_floor_ms"] == pytest.approx(8192 * 56 * 1024 / 15e9 * 1000, abs=0.05)
    assert s["dram_added_vs_floor"] == pytest.approx(50.0 / s["dram_floor_ms"], abs=0.01)
    assert "dram_floor_cpus" not in s
    assert s["cold_vs_baseline"] == pytest.approx(1.02)
    assert "storage_added_ms" not in s, "no storage phase, no storage columns"


def test_a_hybrid_models_hit_is_counted_in_its_keys_bytes_and_set_against_every_layers_kv(capsys):
    # gemma3 shape: 34 layers of 4 KiB per token; a key is one KV cache group's block of 128
    # tokens over 5 layer regions (20 KiB per token). A hit of 8192 tokens loaded 112 keys:
    # 64 of the full-attention group, 8 (its window) of each of the 6 sliding-window groups.
    res = {
        "ttft": {"gpu_hit": [0.19], "dram_hit": [0.266]},
        "served_tokens": {"dram_hit": {"dram": 112 * 128, "storage": 0}},
        "requests": 1,
        "tokens": 8192,
        "model": "m",
        "kv_bytes_per_token": 34 * 4096,
        "loaded_bytes_per_token": 5 * 4096,
        "block_tokens": 128,
        "dram_floor_gbps": {"threads_1": 10.0, "best": 10.0},
    }
    s = ttft.summarize(res)
    assert s["dram_bytes_per_request"] == 112 * 128 * 5 * 4096  # 280 MiB
    ttft.print_table(s)
    out = capsys.readouterr().out
    assert "dram hit of 8192 tokens loaded 280.0 MiB" in out
    assert "(a full-attention model of this shape) would be 1088.0 MiB: 0.257x" in out


def test_the_baseline_half_of_a_cold_pair_is_the_same_prompt_in_lowercase():
    assert ttft.baseline_prompt_for("A", 3) == "a a a "


def test_paired_cold_prompts_alternate_which_half_goes_first():
    assert ttft.cold_pair_order("ABC") == [
        ("cold_no_hpkv", "A"),
        ("cold", "A"),
        ("cold", "B"),
        ("cold_no_hpkv", "B"),
        ("cold_no_hpkv", "C"),
        ("cold", "C"),
    ]


def test_an_order_balanced_ratio_weighs_both_orders_alike():
    from hpkv.bench import order_balanced

    # Whatever runs second is ~30% faster: three pairs one way, two the other. The median of
    # all five (0.8) would blame the side that went first more often.
    assert order_balanced([0.75, 1.3, 0.8, 1.35, 0.7]) == pytest.approx((0.75 + 1.325) / 2)
    assert order_balanced([1.1]) == pytest.approx(1.1)


def test_the_paired_cold_ratio_is_the_median_of_the_pairs_so_a_slow_minute_cancels_out(capsys):
    # The machine slowed 1.5x for the second pair: the means' ratio (63.66 / 63.0) blames hpkv
    # for it, the pairs (1.02, 1.00, 1.02) do not: the baseline-first pairs' median 1.02 and
    # the hpkv-first pair's 1.00 weigh alike.
    t = {"cold_no_hpkv": [20.0, 30.0, 13.0], "cold": [20.4, 30.0, 13.26]}
    assert ttft.cold_vs_baseline(t, paired=False) == pytest.approx(63.66 / 63.0)
    assert ttft.cold_vs_baseline(t, paired=True) == pytest.approx(1.01)
    # Whatever request comes second in a pair is 5% faster: no hpkv effect is reported.
    order_only = {"cold_no_hpkv": [10.0, 9.5, 10.0], "cold": [9.5, 10.0, 9.5]}
    assert ttft.cold_vs_baseline(order_only, paired=True) == pytest.approx((0.95 + 1 / 0.95) / 2)
    assert ttft.cold_vs_baseline({"cold_no_hpkv": [10.0], "cold": [10.3]}, paired=True) == pytest.approx(1.03)
    assert ttft.cold_vs_baseline({"cold": [1.0]}, paired=True) is None
    res = {
        "ttft": t,
        "served_tokens": {},
        "requests": 3,
        "tokens": 8192,
        "model": "m",
        "cold_paired": True,
        "cold_save_ms": 40.0,
    }
    s = ttft.summarize(res)
    assert s["cold_vs_baseline"] == pytest.approx(1.01)
    assert s["cold_save_share"] == pytest.approx(0.04 / 20.4, abs=1e-4)
    ttft.print_table(s)
    out = capsys.readouterr().out
    assert "cold with hpkv / baseline: 1.010, paired prompts, both orders alike (target <= 1.03: met)" in out
    assert "save copies, beside the engine's next step: 40.0 ms per cold request (0.20% of its TTFT)" in out
    with pytest.raises(ValueError):  # a pair that lost a half is a bug, not a shorter median
        ttft.cold_vs_baseline({"cold_no_hpkv": [1.0, 1.0], "cold": [1.0]}, paired=True)
    # The demo's one request per phase: one pair, one order; the line says so.
    one = {**res, "ttft": {"cold_no_hpkv": [4.8], "cold": [7.8]}, "requests": 1}
    ttft.print_table(ttft.summarize(one))
    out = capsys.readouterr().out
    assert "cold with hpkv / baseline: 1.625, one pair; " in out and "--requests 3 or more" in out


def test_the_added_time_pairs_each_hit_with_the_gpu_hit_of_its_repeat(capsys):
    # The machine slowed down between the GPU-hit phase (0.08 s) and the DRAM-hit phase,
    # where a GPU hit took 0.12 s: phase means would say the DRAM hit adds 127 ms; the pairs
    # say 40 ms (their median: one outlier pair does not move it).
    res = {
        "ttft": {
            "gpu_hit": [0.08, 0.08, 0.08],
            "dram_hit": [0.16, 0.16, 0.30],
            "dram_hit_repeat": [0.12, 0.12, 0.12],
        },
        "served_tokens": {"dram_hit": {"dram": 3 * 8192, "storage": 0}},
        "requests": 3,
        "tokens": 8192,
        "model": "m",
        "kv_bytes_per_token": 56 * 1024,
        "dram_floor_gbps": {"threads_1": 10.0, "best": 10.0},
    }
    s = ttft.summarize(res)
    assert s["dram_added_ms"] == pytest.approx(40.0)
    assert s["dram_hit_repeat_s"] == pytest.approx(0.12)
    ttft.print_table(s)
    assert "median of hit − the same prompt again, a GPU hit: mean 0.120 s" in capsys.readouterr().out
    del res["ttft"]["dram_hit_repeat"]  # --url: no repeats, the phases' means
    assert ttft.summarize(res)["dram_added_ms"] == pytest.approx((0.62 / 3 - 0.08) * 1000, abs=0.1)


def test_the_remote_hit_is_set_against_the_raw_batch_get_into_time_of_its_bytes(capsys):
    # --remote: node B's hit of 1 MiB a request adds 3 ms to its GPU hit (pairs); the raw
    # batch_get_into rate measured from node B in the same run was best 1.0 GB/s: 1.05 ms.
    res = {
        "ttft": {
            "remote_cold": [0.9, 0.9],
            "remote_hit": [0.105, 0.104],
            "remote_hit_repeat": [0.102, 0.101],
        },
        "served_tokens": {"remote_hit": {"dram": 0, "storage": 2 * 32, "remote": 2 * 32}},
        "requests": 2,
        "tokens": 40,
        "model": "m",
        "kv_bytes_per_token": 32 * 1024,
        "remote_floor_gbps": {"best": 1.0, "rounds": [0.9, 1.0, 0.95]},
    }
    s = ttft.summarize(res)
    nbytes = 32 * 32 * 1024
    assert s["remote_loaded_tokens"] == 64
    assert s["remote_added_ms"] == pytest.approx(3.0)
    assert s["remote_floor_ms"] == pytest.approx(nbytes / 1e9 * 1000, abs=0.05)
    assert s["remote_added_vs_floor"] == pytest.approx(3.0 / (nbytes / 1e6), abs=0.01)
    ttft.print_table(s)
    out = capsys.readouterr().out
    assert "node B: remote hit (Mooncake)" in out
    assert "remote hit: hpkv adds 3.0 ms" in out and "raw batch_get_into, best of 0.9, 1, 0.95" in out
    assert "spinning on sched_yield" not in out  # no such floor measured: no such line


def _remote_hit(**extra: object) -> dict:
    """A --remote result: node B's hit of 1 MiB a request, 3 ms over its GPU hit (pairs)."""
    return {
        "ttft": {"remote_hit": [0.105, 0.104], "remote_hit_repeat": [0.102, 0.101]},
        "served_tokens": {"remote_hit": {"dram": 0, "storage": 0, "remote": 2 * 32}},
        "requests": 2,
        "tokens": 40,
        "model": "m",
        "kv_bytes_per_token": 32 * 1024,
        **extra,
    }


def test_the_remote_hit_is_also_set_against_the_floor_beside_a_spinning_engine(capsys):
    # the same hit; the raw gets beside a process spinning on sched_yield ran at 0.5 GB/s: 2.1 ms
    res = _remote_hit(
        remote_floor_gbps={"best": 1.0, "rounds": [1.0]},
        remote_floor_spin_gbps={"best": 0.5, "rounds": [0.4, 0.5]},
    )
    s = ttft.summarize(res)
    spin_ms = 32 * 32 * 1024 / 0.5e9 * 1000
    assert s["remote_floor_spin_ms"] == pytest.approx(spin_ms, abs=0.05)
    assert s["remote_added_vs_floor_spin"] == pytest.approx(3.0 / spin_ms, abs=0.01)
    assert s["remote_added_vs_floor"] == pytest.approx(2 * s["remote_added_vs_floor_spin"], abs=0.02)
    ttft.print_table(s)
    out = capsys.readouterr().out
    assert f"floor {spin_ms:.1f} ms (raw batch_get_into, best of 0.4, 0.5 GB/s)" in out


def test_the_remote_hit_shows_whether_the_machines_cpus_bound_it(capsys):
    # the raw gets of 2 MiB took 0.004 and 0.006 CPU-s of the machine (at 1.0 and 0.5 GB/s);
    # a hit of 1 MiB took 0.016 CPU-s more than its GPU hit, on 2 CPUs at least 8 ms
    res = _remote_hit(
        cpus=2,
        remote_floor_gbps={
            "best": 1.0,
            "rounds": [1.0, 0.5],
            "bytes": 2 << 20,
            "machine_cpu_s": [0.004, 0.006],
        },
        cpu_s_per_request={
            "remote_hit": {"engine": 0.01, "hpkv": 0.004, "machine": 0.02},
            "remote_hit_repeat": {"engine": 0.002, "hpkv": 0.0, "machine": 0.004},
        },
    )
    s = ttft.summarize(res)
    floor_ms = (1 << 20) / 1e9 * 1000
    assert s["remote_floor_machine_cpu_s"] == pytest.approx(0.0025, abs=1e-4)
    assert s["remote_floor_cpus_busy"] == pytest.approx((0.004 / 2.097e-3 + 0.006 / 4.194e-3) / 2, abs=0.01)
    assert s["remote_added_machine_cpu_s"] == {"machine": 0.016, "engine": 0.008, "hpkv": 0.004}
    assert s["remote_cpu_bound_ms"] == pytest.approx(8.0)
    assert s["remote_cpu_bound_vs_floor"] == pytest.approx(8.0 / floor_ms, abs=0.01)
    ttft.print_table(s)
    out = capsys.readouterr().out
    assert (
        "a remote hit added 0.016 CPU-s to its GPU hit (vLLM 0.008, this node's hpkv 0.004, the rest 0.004"
        in out
    )
    assert f"at least 8.0 ms on 2 CPUs -> {8.0 / floor_ms:.3f}x the floor by CPU work alone" in out
    del res["cpu_s_per_request"]["remote_hit_repeat"]  # nothing to set the hit against: no such line
    ttft.print_table(ttft.summarize(res))
    assert "the machine's CPU" not in capsys.readouterr().out


def test_machine_busy_seconds_count_this_process_work():
    from hpkv.bench.floors import machine_busy_s

    b0, c0 = machine_busy_s(), time.process_time()
    while time.process_time() - c0 < 0.3:
        pass
    assert machine_busy_s() - b0 >= 0.25  # (ticks of 10 ms; every CPU counts, others' work too)


def test_remote_phases_skip_with_the_reason_where_namespaces_cannot_be_made(monkeypatch, capsys):
    monkeypatch.setattr(ttft, "remote_unavailable", lambda: "needs root to create network namespaces")
    results: dict = {"requests": 1}
    ttft.remote_phases(argparse.Namespace(), {}, "/nonexistent", 0, results, {}, ("m", [], 0, 0), print)
    assert results["remote_skipped"] == "needs root to create network namespaces"
    ttft.print_table(ttft.summarize({**results, "ttft": {}, "tokens": 1, "model": "m", "served_tokens": {}}))
    assert "remote phases skipped: needs root to create network namespaces" in capsys.readouterr().out


@pytest.mark.parametrize(
    "engine_cpu_s,free,gbps",
    [(0.244, 1.12, 10.6), (0.21, 1.8, 14.0), (0.40, 1, 10.0), (0.2, 2, 15.0)],
    ids=["engine-polls-a-cpu", "engine-nearly-idle", "engine-busier-than-all-cpus", "engine-idle"],
)
def test_the_dram_floor_counts_only_the_cpus_the_engine_leaves_free(engine_cpu_s, free, gbps, capsys):
    # GPU hit 0.1 s at 0.2 CPU-s; the DRAM hit adds 50 ms. An engine that burns 0.044 CPU-s
    # more (0.88 CPUs during the load) leaves 1.12 of 2 CPUs to the copy, whose floor is
    # between the 1- and 2-thread memcpy; one that burns 0.01 more leaves 1.8.
    res = {
        "ttft": {"gpu_hit": [0.1], "dram_hit": [0.15]},
        "served_tokens": {"dram_hit": {"dram": 8192, "storage": 0}},
        "requests": 1,
        "tokens": 8192,
        "model": "m",
        "cpus": 2,
        "kv_bytes_per_token": 56 * 1024,
        "dram_floor_gbps": {"threads_1": 10.0, "threads_2": 15.0, "best": 15.0},
        "cpu_s_per_request": {"gpu_hit": {"engine": 0.2, "hpkv": 0.0}, "dram_hit": {"engine": engine_cpu_s}},
    }
    s = ttft.summarize(res)
    nbytes = 8192 * 56 * 1024
    assert s["dram_floor_cpus"] == free
    assert s["dram_engine_cpus_during_load"] == pytest.approx((engine_cpu_s - 0.2) / 0.05, abs=0.01)
    assert s["dram_floor_ms"] == pytest.approx(nbytes / (gbps * 1e9) * 1000, abs=0.05)
    assert s["dram_floor_all_cpus_ms"] == pytest.approx(nbytes / 15e9 * 1000, abs=0.05)
    assert s["dram_added_vs_floor_all_cpus"] == pytest.approx(50.0 / s["dram_floor_all_cpus_ms"], abs=0.01)
    ttft.print_table(s)
    out = capsys.readouterr().out
    assert f"on the {free:g} of 2 CPU(s) the engine leaves free" in out
    assert "against all 2 CPUs, as if the engine used none" in out


def test_the_engines_cpu_during_a_load_is_set_against_the_gpu_hit_right_after_it():
    # The GPU-hit phase ran minutes earlier at 0.3 CPU-s (its compute threads spun longer): set
    # against it, the engine looks idle during the load. The repeats, each right after its hit,
    # cost 0.2 CPU-s: the engine kept (0.244 - 0.2) / 0.05 = 0.88 CPUs busy.
    res = {
        "ttft": {"gpu_hit": [0.1], "dram_hit": [0.15], "dram_hit_repeat": [0.1]},
        "cpu_s_per_request": {
            "gpu_hit": {"engine": 0.3},
            "dram_hit": {"engine": 0.244},
            "dram_hit_repeat": {"engine": 0.2},
        },
    }
    assert ttft.engine_cpus_during_load(res, "dram_hit", 0.05) == pytest.approx(0.88)
    del res["cpu_s_per_request"]["dram_hit_repeat"]
    assert ttft.engine_cpus_during_load(res, "dram_hit", 0.05) == 0.0


def test_the_memcpy_rate_on_a_fraction_of_the_cpus_is_interpolated():
    rates = {1: 10.0, 2: 16.0, 4: 15.0}
    assert ttft.rate_on_cpus(rates, 1.0) == 10.0
    assert ttft.rate_on_cpus(rates, 1.5) == pytest.approx(13.0)
    assert ttft.rate_on_cpus(rates, 3.0) == 16.0, "never below a thread count that fits"
    assert ttft.rate_on_cpus(rates, 8.0) == 16.0
    assert ttft.rate_on_cpus(rates, 0.5) == 10.0
    assert ttft.rate_on_cpus({}, 2.0) is None


def test_memcpy_floor_thread_counts_stop_at_the_cpus_and_eight():
    assert ttft.memcpy_thread_counts(1) == (1,)
    assert ttft.memcpy_thread_counts(2) == (1, 2)
    assert ttft.memcpy_thread_counts(6) == (1, 2, 4)
    assert ttft.memcpy_thread_counts(64) == (1, 2, 4, 8)


def test_the_cpu_meter_counts_a_process_tree_and_no_server_as_zero(tmp_path):
    import subprocess
    import sys

    meter = ttft.CpuMeter(str(tmp_path / "no-pool"), requests=2)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)",
        ]
    )
    try:
        meter.start("cold", child.pid)
        time.sleep(3)  # the child's 0.6 s of CPU ends well within it, even on a busy machine
        meter.stop("cold", child.pid)
    finally:
        child.kill()
        child.wait()
    per = meter.per_request["cold"]
    assert per["hpkv"] == 0.0 and 0.1 <= per["engine"] <= 0.4, per


def test_the_cpu_meter_leaves_a_paused_stretch_out(tmp_path):
    import subprocess
    import sys

    meter = ttft.CpuMeter(str(tmp_path / "no-pool"), requests=1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)\nwhile True: pass"])
    try:
        meter.start("dram_hit", child.pid)
        time.sleep(1.0)  # idle: counted
        with meter.paused("dram_hit", child.pid, into="dram_hit_repeat"):
            time.sleep(2.5)  # the child spins from 1.5 s on: left out, counted as the repeat's
        meter.stop("dram_hit", child.pid)
    finally:
        child.kill()
        child.wait()
    assert meter.per_request["dram_hit"]["engine"] < 0.3, meter.per_request
    assert meter.per_request["dram_hit_repeat"]["engine"] > 0.5, meter.per_request


def test_floors_measure_something_real(tmp_path):
    m = memcpy_gbps(8 << 20, directory="/dev/shm", threads=(1, 2), repeat=2)
    assert m["best"] == max(m["threads_1"], m["threads_2"]) > 0.1
    paths = []
    for i in range(4):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(1 << 20))
        paths.append(str(p))
    r = raw_read_gbps(paths, threads=(1, 2), repeat=1)
    assert r["best"] > 0.01 and set(r) == {"threads_1", "threads_2", "best", "o_direct"}


def test_gap_statistics_cover_the_gaps_that_end_inside_the_window():
    from hpkv.bench.interference import gap_stats

    times = [0.0, 0.05, 0.10, 0.40, 0.45, 0.50]  # one 300 ms stall between 0.10 and 0.40
    assert gap_stats(times) == {"p50_ms": 50.0, "max_ms": 300.0, "gaps": 5}
    assert gap_stats(times, window=(0.2, 0.3))["max_ms"] == 300.0, "a stall that spans the window counts"
    assert gap_stats(times, window=(0.46, 0.5)) == {"p50_ms": 50.0, "max_ms": 50.0, "gaps": 1}
    assert gap_stats([1.0])["gaps"] == 0
    # The write-through window opens after the prefill: the gap already running then is the
    # prefill's, not the write-through's.
    assert gap_stats(times, window=(0.2, 0.46), starting_inside=True) == {
        "p50_ms": 50.0,
        "max_ms": 50.0,
        "gaps": 2,
    }
    assert gap_stats(times, window=(0.2, 0.3), starting_inside=True)["gaps"] == 0


def test_a_case_measured_in_several_rounds_pools_their_gaps():
    from hpkv.bench.interference import merged

    rounds = [
        {"_times": [0.0, 0.05, 0.10, 0.40], "_window": (0.2, 0.3), "max_ms": 300.0, "window_s": 0.1},
        {"_times": [1.0, 1.02, 1.04], "_window": (1.0, 1.05), "max_ms": 20.0, "window_s": 0.05},
    ]
    for r in rounds:
        r["stream_tokens"] = [0, len(r["_times"])]
    assert merged(rounds) == {
        "p50_ms": 20.0,
        "max_ms": 300.0,
        "gaps": 3,
        "max_ms_per_round": [300.0, 20.0],
        "window_s": [0.1, 0.05],
        "stream_tokens": [[0, 4], [0, 3]],
    }


def test_interference_measures_each_hit_case_in_rounds_with_its_ttft_and_tiers(monkeypatch):
    from hpkv.bench import interference

    def stream(url, model, prompt, max_tokens, times=None):
        times = [] if times is None else times
        for _ in range(40):
            time.sleep(0.002)
            times.append(time.perf_counter())
        return times

    monkeypatch.setattr(interference, "stream_token_times", stream)
    asked: list[dict | None] = []
    served = {"dram": 0, "storage": 0}

    def ttft(prompt: str, extra: dict | None) -> float:
        asked.append(extra)
        served["storage" if len(asked) == 1 else "dram"] += 8  # the first hit reads storage
        time.sleep(0.01)
        return 0.01

    def loads() -> dict[str, int]:
        time.sleep(0.1)  # `hpkv status`: longer than the whole fake stream
        return dict(served)

    resets: list[int] = []
    out = interference.measure("http://x", "m", "Y ", "X ", lambda: 0, ttft, lambda: resets.append(1), loads)
    rounds = interference.DRAM_ROUNDS
    assert out["storage_hit_served"] == [{"dram": 0, "storage": 8}]
    assert out["dram_hit_in_step_served"] == [{"dram": 8, "storage": 0}] * rounds
    for case in interference.DRAM_CASES:
        assert len(out[f"{case}_ttft_s"]) == rounds
        assert out[f"during_{case}"]["gaps"] > 0 and "max_vs_alone_max" in out[f"during_{case}"]
    assert {k: len(v) for k, v in out["dram_hit_alone_ttft_s"].items()} == {
        "in_step": rounds,
        "background": rounds,
    }
    assert len(resets) == 4 * rounds, "every DRAM hit follows a reset of the engine's cache, no GPU hit does"
    for case in interference.DRAM_CASES:
        before, total = zip(*out[f"during_{case}"]["stream_tokens"], strict=True)
        assert max(before) < min(total), "each hit ran while the stream did, not after reading the counters"
    streamed = asked[1 : 1 + 3 * rounds]
    assert streamed[:6] == [interference.IN_STEP, None, None, None, None, interference.IN_STEP], "ABC CBA"
    assert asked[-1] is None, "the cold prompt last, as configured"


def test_the_interference_poll_reads_the_same_spill_gauge_as_hpkv_status(tmp_path):
    # The write-through window polls this every 20 ms while a client streams: it must read
    # the segment in-process (not start `hpkv status`) and agree with what status reports.
    from hpkv.protocol.stats import G, StatsSegment, spills_pending

    assert spills_pending(str(tmp_path)) == 0, "no server: nothing pending"
    seg = StatsSegment.create(str(tmp_path))
    try:
        seg.glob[G.STORAGE_SPILLS_PENDING] = 7
        assert spills_pending(str(tmp_path)) == 7
        assert seg.snapshot()["storage"]["spills_pending"] == 7
    finally:
        seg.close()


def test_the_save_time_of_a_cold_request_is_the_transfer_workers_busy_time(tmp_path):
    from hpkv.protocol.stats import StatsSegment, W

    assert ttft.transfer_busy_s(str(tmp_path)) == {}, "no server: nothing copied"
    seg = StatsSegment.create(str(tmp_path))
    try:
        workers = [
            {"slot": 0, "kind": "transfer"},
            {"slot": 1, "kind": "io"},
            {"slot": 2, "kind": "transfer"},
        ]
        seg.write_catalog({"workers": workers})
        seg.workers[0][W.BUSY_NS] = 35_000_000
        seg.workers[1][W.BUSY_NS] = 900_000_000  # an IO worker's spills are not on the engine's path
        seg.workers[2][W.BUSY_NS] = 10_000_000
        before = ttft.transfer_busy_s(str(tmp_path))
        assert before == {0: pytest.approx(0.035), 2: pytest.approx(0.01)}
        seg.workers[0][W.BUSY_NS] += 40_000_000  # two ranks' workers copy side by side
        seg.workers[2][W.BUSY_NS] += 44_000_000
        assert ttft.busiest_since(before, ttft.transfer_busy_s(str(tmp_path))) == pytest.approx(0.044)
    finally:
        seg.close()


def test_bench_io_refuses_a_directory_without_room_for_its_files_and_leaves_nothing(tmp_path):
    # Its files stay until the end of the run: a disk that fills half-way would pause hpkv's
    # spilling and leave the bench waiting. It says so up front instead.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hpkv", "bench", "io", "--dir", str(tmp_path), "--repeat", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "is on tmpfs" in out.stdout:
        pytest.skip("the test directory is on tmpfs")
    assert out.returncode == 2, out
    assert "MiB free; the run writes about" in out.stdout and "--mib" in out.stdout
    assert os.listdir(tmp_path) == []


class _Engine:
    url, model_name, pid = "http://127.0.0.1:1", "m", None


def test_paired_cold_sends_each_pair_in_turn_and_keeps_the_halves_apart(monkeypatch, tmp_path):
    sent: list[tuple[str, dict | None]] = []
    busy = {0: 0.0}

    def first_byte(url, model, prompt, extra=None, timeout=600.0):
        sent.append((prompt[:4], extra))
        if extra is None:
            busy[0] += 0.04  # hpkv's saves of this prompt
        return (5.0 if extra else 5.1), 8193

    monkeypatch.setattr(ttft, "first_byte", first_byte)
    monkeypatch.setattr(ttft, "wait_for_write_through", lambda pool_dir: 0.1)
    monkeypatch.setattr(ttft, "transfer_busy_s", lambda pool_dir: dict(busy))
    monkeypatch.setattr(ttft, "COLD_SETTLE_S", 0.0)
    meter = ttft.CpuMeter(str(tmp_path), requests=2)
    loads = iter([{"dram": 0, "storage": 0}, {"dram": 0, "storage": 0}])
    times, served, extra = ttft.paired_cold(_Engine(), "AB", 4, str(tmp_path), meter, lambda: next(loads))
    skip = {"kv_transfer_params": {"hpkv_skip": True}}
    assert sent == [("a a ", skip), ("A A ", None), ("B B ", None), ("b b ", skip)]
    assert times == {"cold_no_hpkv": [5.0, 5.0], "cold": [5.1, 5.1]}
    assert served == {"dram": 0, "storage": 0}
    assert extra["cold_save_ms"] == pytest.approx(40.0) and extra["cold_paired"] is True
    assert set(meter.per_request) == {"cold", "cold_no_hpkv"}

    monkeypatch.setattr(
        ttft, "first_byte", lambda url, model, prompt, extra=None: (5.0, 8193 if extra else 8194)
    )
    loads = iter([{"dram": 0, "storage": 0}] * 2)
    with pytest.raises(RuntimeError, match="not as long"):
        ttft.paired_cold(_Engine(), "A", 4, str(tmp_path), meter, lambda: next(loads))


def test_a_thread_that_ends_keeps_the_cpu_it_was_seen_with():
    import subprocess
    import sys

    import psutil

    # The thread spins for 0.6 s of its own CPU time, not of wall time: on a loaded machine it
    # may get little of the CPU, and the test waits for what it got rather than for a clock.
    code = (
        "import threading, time\n"
        "def spin():\n"
        "    while time.thread_time() < 0.6: pass\n"
        "threading.Thread(target=spin).start()\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        seen: dict[int, float] = {}
        deadline = time.monotonic() + 30
        while_spinning = 0.0
        while while_spinning <= 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
            while_spinning = ttft._tree_cpu_s(child.pid, seen)
        proc = psutil.Process(child.pid)
        while proc.num_threads() > 1 and time.monotonic() < deadline:  # the thread has ended
            time.sleep(0.05)
        assert proc.num_threads() == 1, "the spinning thread ended"
        assert ttft._tree_cpu_s(child.pid, seen) >= while_spinning > 0.2
        assert ttft._tree_cpu_s(child.pid) < while_spinning, "without memory the ended thread's CPU is gone"
    finally:
        child.kill()
        child.wait()


def test_bench_scale_reports_memory_scan_rate_first_hit_and_latencies_and_removes_its_files(tmp_path, capsys):
    from hpkv.bench import scale
    from hpkv.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "scale", "--json", "--n", "500", "--lookups", "50", "--dir", str(tmp_path / "s")]
    )
    assert scale.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["runs"]
    assert row["n"] == 500 and row["stored_files"] == 500, "every file passed the scan's checks"
    assert row["bytes_per_block"] > 0 and row["scan_files_per_s"] > 0
    assert row["attach_to_first_hit_ms"] is not None and row["full_hits_after"] > 0
    # every stored key was found, or its lookup ended at the bound while a stat still ran
    assert row["full_hits_after"] + row["unconfirmed_after"] == 50
    assert row["hit_after_p50_us"] > 0 and row["miss_after_p99_us"] > 0
    assert not (tmp_path / "s").exists(), "the files are removed, and the directory it made"


def test_bench_admit_writes_every_block_under_always_and_only_reused_ones_under_reuse(tmp_path, capsys):
    from hpkv.bench import admit
    from hpkv.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "admit", "--json", "--users", "2", "--turns", "3", "--system-blocks", "4"]
        + ["--turn-blocks", "2", "--one-shots", "1", "--block-kib", "16", "--pool", "64m"]
        + ["--policies", "always,reuse:1", "--dir", str(tmp_path)]
    )
    assert admit.run(args) == 0
    always, reuse = json.loads(capsys.readouterr().out)["runs"]
    distinct = 4 + 2 * 3 * 2 + 3 * admit.ONE_SHOT_BLOCKS  # system, histories, one-shot prompts
    assert always["files"] == distinct and always["admit_deferred"] == 0
    assert reuse["admit_deferred"] == distinct
    # a 64 MiB pool holds everything: written are exactly the blocks a later prompt hit,
    # the system prompt and every history block but the last turn's; no one-shot block
    assert reuse["files"] == reuse["admitted"] == 4 + 2 * 2 * 2
    assert always["after_restart"]["recomputed"] == 2 * 4, "only the new message is recomputed"
    assert reuse["after_restart"]["recomputed"] == 2 * (2 + 4), "and the last turn, never reused"
    assert os.listdir(tmp_path) == [], "the storage directories are removed"


def test_bench_admit_compares_dram_evictions_and_s3fifo_keeps_the_reused_prompts_through_scans(
    tmp_path, capsys
):
    """A 16-block pool, two users' 4-block system prompt and histories, one-shot prompts of 12
    blocks between turns: LRU loses the reused prefix to every scan, S3-FIFO keeps it in DRAM."""
    from hpkv.bench import admit
    from hpkv.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "admit", "--json", "--users", "2", "--turns", "4", "--system-blocks", "4"]
        + ["--turn-blocks", "1", "--one-shots", "2", "--one-shot-blocks", "12", "--block-kib", "64"]
        + ["--pool", "1m", "--policies", "always", "--evictions", "lru,s3fifo", "--settle"]
        + ["--dir", str(tmp_path)]
    )
    assert admit.run(args) == 0
    lru, s3 = json.loads(capsys.readouterr().out)["runs"]
    assert (lru["eviction"], s3["eviction"]) == ("lru", "s3fifo")
    assert lru["blocks"] == s3["blocks"] and lru["files"] == s3["files"], "the same traffic, all written"
    assert s3["dram_hits"] > lru["dram_hits"] and s3["bytes_promoted"] < lru["bytes_promoted"]
    assert os.listdir(tmp_path) == []
