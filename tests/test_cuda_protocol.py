"""The CUDA job protocol through a real server, real rings and real transfer worker processes,
with only the CUDA driver replaced by host memory (``cuda.driver = "host"``): the KV
"allocation" is a shared-memory file, the engine's interprocess events are int64 cells another
process holds pending, and descriptors run with memcpy."""

from __future__ import annotations

import mmap
import os
import signal
import time

import numpy as np
import pytest

from hpkv.client import connect
from hpkv.common.pool import PoolFile
from hpkv.protocol import wire as P
from hpkv.protocol.errors import HpkvError, Status
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.protocol.stats import StatsSegment, W

LAYERS, BLOCKS, PAGE, EVENTS = 4, 32, 4096, 8
FP = namespace_fingerprint({"model": "cuda-protocol-test", "layers": LAYERS})


def _map(path: str, nbytes: int) -> np.ndarray:
    with open(path, "wb") as f:
        f.truncate(nbytes)
    fd = os.open(path, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
    finally:
        os.close(fd)


class HostGpu:
    """An engine's side of a host-driver CUDA device: one KV allocation in LB or BL nesting."""

    def __init__(self, directory: str, nesting: str):
        self.nesting = nesting
        if nesting == "BL":
            self.stride, self.offsets = LAYERS * PAGE, [ly * PAGE for ly in range(LAYERS)]
        else:
            self.stride, self.offsets = PAGE, [ly * BLOCKS * PAGE for ly in range(LAYERS)]
        self.kv_path = os.path.join(directory, f"kv-{nesting}")
        self.kv = _map(self.kv_path, LAYERS * BLOCKS * PAGE)
        self.ev_path = os.path.join(directory, f"events-{nesting}")
        self.events = _map(self.ev_path, 8 * EVENTS).view(np.int64)

    def register(self, client, ns_id: int, job_timeout_s: float = 10.0):
        return client.register_device(
            ns_id,
            rank=0,
            regions=[{"path": self.kv_path, "size": self.kv.size}],
            layer_bases=[(0, o) for o in self.offsets],
            block_stride=self.stride,
            page_bytes=PAGE,
            num_blocks=BLOCKS,
            device="cuda",
            cuda={
                "driver": "host",
                "events": self.ev_path,
                "num_events": EVENTS,
                "job_timeout_s": job_timeout_s,
            },
        )

    def block_bytes(self, b: int) -> bytes:
        return b"".join(
            self.kv[o + b * self.stride : o + b * self.stride + PAGE].tobytes() for o in self.offsets
        )


def _setup(server, tmp_path, nesting: str = "BL", **kw):
    c = connect(server.cfg, spawn=False)
    ns = c.attach_namespace(FP, 1, LAYERS * PAGE)
    gpu = HostGpu(str(tmp_path), nesting)
    gpu.kv[:] = np.random.default_rng(7).integers(0, 256, gpu.kv.size, dtype=np.uint8)
    handle = gpu.register(c, ns.ns_id, **kw)
    offsets = c.reserve(ns.ns_id, block_keys(FP, [b"k%d" % i for i in range(16)]))[:, 0]
    return c, ns, gpu, handle, offsets


@pytest.mark.parametrize("nesting", ["BL", "LB"])
def test_a_save_waits_for_the_engine_event_then_every_byte_arrives(server, tmp_path, nesting):
    c, _, gpu, handle, offsets = _setup(server, tmp_path, nesting)
    with c:
        pool = PoolFile.attach(os.path.join(server.pool_dir, P.POOL_FILE))
        blocks = np.array([3, 4, 5, 6, 20, 1, 31, 0], np.int64)
        gpu.events[2] = 1  # the engine's forward that writes these blocks is still running
        tickets = handle.submit(P.COPY_SAVE, blocks, offsets[:8], event=2)
        time.sleep(0.3)
        assert handle.poll(tickets) == {}, "the save completed before the engine's event"
        o0 = P.slot_offset(offsets[0])
        assert not pool.array[o0 : o0 + LAYERS * PAGE].any(), "copied before the event"
        gpu.events[2] = 0  # the forward finished
        assert list(handle.wait(tickets, timeout=10).values()) == [0]
        for b, off in zip(blocks, P.slot_offset(offsets[:8]), strict=True):
            assert pool.array[off : off + LAYERS * PAGE].tobytes() == gpu.block_bytes(b)
        expected = {int(b): gpu.block_bytes(b) for b in blocks}
        gpu.kv[:] = 0
        dst = np.array([10, 11, 12, 13, 2, 7, 8, 9], np.int64)
        assert handle.load(dst, offsets[:8])  # no event: a load right away
        for s, d in zip(blocks, dst, strict=True):
            assert gpu.block_bytes(d) == expected[int(s)]
        pool.close()
        (w,) = c.stats()["workers"]
        assert w["bytes_saved"] == w["bytes_loaded"] == 8 * LAYERS * PAGE


def test_an_event_that_never_completes_fails_the_job_within_its_bound(server, tmp_path):
    c, _, gpu, handle, offsets = _setup(server, tmp_path, job_timeout_s=1.0)
    with c:
        gpu.events[5] = 1  # a forward that never finishes (a hung engine stream)
        t0 = time.monotonic()
        (status,) = handle.wait(
            handle.submit(P.COPY_SAVE, np.array([1, 2]), offsets[:2], event=5), 10
        ).values()
        assert status == Status.INTERNAL and time.monotonic() - t0 < 5
        assert "waiting 1s for event 5" in server.log()
        gpu.events[5] = 0
        assert handle.save(np.array([1, 2]), offsets[:2])  # the worker still serves


def test_a_worker_killed_during_a_load_reports_the_load_failed_and_is_replaced(server, tmp_path):
    c, _, gpu, handle, offsets = _setup(server, tmp_path)
    with c:
        slot = c.stats()["workers"][0]["slot"]
        row = StatsSegment.attach(server.pool_dir).workers[slot]
        pid = int(row[W.PID])
        gpu.events[0] = 1  # the worker will sit in the load, waiting for this event
        tickets = handle.submit(P.COPY_LOAD, np.arange(4), offsets[:4], event=0)
        deadline = time.monotonic() + 10
        while int(row[W.INFLIGHT_SEQ]) != tickets[0][1]:
            assert time.monotonic() < deadline, "the worker never took the load"
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert list(handle.wait(tickets, timeout=10).values()) == [Status.WORKER_DIED]
        assert time.monotonic() - t0 < 5
        gpu.events[0] = 0
        deadline = time.monotonic() + 20
        while not handle.save(np.arange(2), offsets[:2]):  # the restarted worker re-imports and serves
            assert time.monotonic() < deadline, "no replacement worker"
            time.sleep(0.2)
        assert int(row[W.PID]) != pid


@pytest.mark.parametrize(
    ("cuda", "message"),
    [
        ({"driver": "nvlink"}, "driver 'cuda' or 'host'"),
        (
            {"driver": "cuda", "uuid": "zz" * 16, "mem_handle": "00" * 64, "alloc_offset": 0,
             "alloc_bytes": 1 << 20, "events": []},
            "cuda.uuid must be 32 lowercase hex digits",
        ),
        (
            {"driver": "cuda", "uuid": "ab" * 16, "mem_handle": "00" * 64, "alloc_offset": 0,
             "alloc_bytes": 4096, "events": []},
            r"layer_bases\[0\] = \[0, 0\]: 32 blocks x 16384 B from there do not fit the 4096 B KV buffer",
        ),
    ],
)  # fmt: skip
def test_a_bad_cuda_registration_is_refused_with_the_value(server, cuda, message):
    with connect(server.cfg, spawn=False) as c:
        ns = c.attach_namespace(FP, 1, LAYERS * PAGE)
        with pytest.raises(HpkvError, match=message):
            c.register_device(
                ns.ns_id,
                rank=0,
                regions=[],
                layer_bases=[(0, ly * PAGE) for ly in range(LAYERS)],
                block_stride=LAYERS * PAGE,
                page_bytes=PAGE,
                num_blocks=BLOCKS,
                device="cuda",
                cuda=cuda,
            )
