"""The connector's CUDA worker side against a real server, rings and transfer worker, with only the
GPU replaced by host memory (:class:`HostBackend`): the KV cache is built with vLLM 0.32's views
(BLNHC) over a shared-memory file, and events are cells the test holds pending like a GPU
stream whose forward is still running."""

from __future__ import annotations

import logging
import mmap
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")  # the connector's metadata types come from vLLM

from hpkv.client import connect  # noqa: E402
from hpkv.connectors.vllm.cuda_layout import vllm_views  # noqa: E402
from hpkv.connectors.vllm.cuda_worker import CudaBackend, CudaWorkerSide, HostBackend  # noqa: E402
from hpkv.connectors.vllm.layout import Layout  # noqa: E402
from hpkv.connectors.vllm.metadata import HpkvMetadata, LoadOp, SaveOp  # noqa: E402
from hpkv.connectors.vllm.worker import SaveTracker  # noqa: E402
from hpkv.protocol.keys import block_keys, namespace_fingerprint  # noqa: E402
from hpkv.protocol.stats import StatsSegment, W  # noqa: E402

L, H, N, D, BLOCKS = 4, 4, 16, 16, 32
PAGE = H * N * 2 * D * 2  # 4 KiB
FP = namespace_fingerprint({"model": "cuda-connector-test"})
LAYOUT = Layout(FP, "cuda-test", 1, N, L, PAGE)


class Rank:
    """One CUDA worker side (host backend) and its KV cache, connected to ``server``."""

    def __init__(self, server, tmp_path, ipc: bool = True):
        nbytes = L * BLOCKS * PAGE
        kv_path = str(tmp_path / "kv")
        with open(kv_path, "wb") as f:
            f.truncate(nbytes)
        fd = os.open(kv_path, os.O_RDWR)
        self.mm = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.buf = torch.frombuffer(self.mm, dtype=torch.int8)
        self.buf.copy_(torch.randint(-128, 128, (nbytes,), dtype=torch.int8))
        views = vllm_views(self.buf, "BLNHC", L, BLOCKS, H, N, 2 * D * 2, torch.bfloat16)
        self.kv = {f"model.layers.{i}.attn": v for i, v in enumerate(views)}
        self.backend = HostBackend(kv_path, str(tmp_path / "events"), events=8, ipc=ipc)
        self.clients = []

        def open_store(spec):
            c = connect(server.cfg, spawn=False, call_timeout=5.0)
            self.clients.append(c)
            ns = c.attach_namespace(FP, 1, L * PAGE, rank=0)
            if spec.get("in_process"):  # as the connector does: no transfer worker
                return c, ns.ns_id, None
            return c, ns.ns_id, c.register_device(ns.ns_id, rank=0, **spec)

        kvc = SimpleNamespace(kv_cache_layout="BLNHC", num_blocks=BLOCKS, kv_cache_tensors=[])
        self.side = CudaWorkerSide(
            LAYOUT, 0, server.pool_dir, open_store, backend=self.backend, kv_cache_config=kvc
        )
        self.sched = connect(server.cfg, spawn=False)
        self.ns = self.sched.attach_namespace(FP, 1, L * PAGE)

    def block(self, b: int) -> bytes:
        return bytes(self.mm[b * L * PAGE : (b + 1) * L * PAGE])

    def save_op(self, req: str, blocks: list[int], tag: str) -> SaveOp:
        keys = block_keys(FP, [f"{tag}{i}".encode() for i in range(len(blocks))])
        return SaveOp(req, keys, blocks, self.sched.reserve(self.ns.ns_id, keys))

    def close(self):
        self.side.shutdown()
        self.sched.close()


@pytest.fixture
def rank(server, tmp_path):
    r = Rank(server, tmp_path)
    r.side.register_kv_caches(r.kv)
    assert r.side.enabled
    yield r
    r.close()


def _until(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (out := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return out


def test_a_save_returns_at_once_and_the_request_is_freed_once_copied(rank):
    op = rank.save_op("r1", [5, 6, 7, 20], "a")
    expected = [rank.block(b) for b in op.block_ids]
    rank.backend.hold = True  # the forward that writes these blocks is still running on the GPU
    t0 = time.monotonic()
    rank.side.wait_for_save(HpkvMetadata(saves=[op]))
    assert time.monotonic() - t0 < 0.5, "wait_for_save must not wait for the copy"
    time.sleep(0.3)
    assert rank.side.finished_saves({"r1"}) == set(), "freed while its save was in flight"
    rank.backend.cells[:] = 0  # the forward finished
    assert _until(lambda: rank.side.finished_saves(set())) == {"r1"}
    hit, _ = rank.sched.lookup(rank.ns.ns_id, op.keys)
    assert hit == 4  # committed
    # and back into other blocks, through the load path (event + bounded host wait)
    rank.backend.hold = False
    offsets = rank.sched.pin(rank.ns.ns_id, op.keys)
    rank.side.start_load_kv(HpkvMetadata(loads=[LoadOp("r2", op.keys, [1, 2, 3, 4], offsets)]))
    assert rank.side.take_load_errors() == set()
    assert [rank.block(b) for b in (1, 2, 3, 4)] == expected


def test_a_request_without_saves_is_never_delayed_and_one_with_saves_always_reported():
    tracker = SaveTracker()
    tracker.scheduled(HpkvMetadata(saves=[SaveOp("s", [], [], np.zeros((0, 1), np.int64))]))
    tracker.started(["s"])
    assert tracker.finished({"s", "other"}) == set()
    tracker.ended(["s"])
    assert tracker.finished(set()) == {"s"}
    assert tracker.finished({"s"}) == set()  # reported once


def test_a_worker_killed_during_a_save_releases_the_blocks_and_aborts(rank, server):
    op = rank.save_op("r9", [1, 2], "k")
    slot = rank.clients[0].stats()["workers"][0]["slot"]
    row = StatsSegment.attach(server.pool_dir).workers[slot]
    rank.backend.hold = True
    rank.side.wait_for_save(HpkvMetadata(saves=[op]))
    _until(lambda: int(row[W.INFLIGHT_SEQ]) != 0)
    os.kill(int(row[W.PID]), signal.SIGKILL)
    t0 = time.monotonic()
    assert _until(lambda: rank.side.finished_saves({"r9"})) == {"r9"}
    assert time.monotonic() - t0 < 5
    assert rank.side.stats.data["save_failed_blocks"] == 2
    assert rank.sched.lookup(rank.ns.ns_id, op.keys)[0] == 0  # aborted, never visible


def test_preempted_requests_saves_finish_before_their_blocks_are_reused(rank):
    op = rank.save_op("p1", [3], "p")
    rank.backend.hold = True
    rank.side.wait_for_save(HpkvMetadata(saves=[op]))
    rank.backend.cells[:] = 0
    rank.side.handle_preemptions({"p1"})  # returns once the save completed
    assert rank.side.tracker.inflight == {}


def test_without_libcuda_the_worker_disables_itself_with_one_line(server, tmp_path, caplog):
    from hpkv.common.cuda import cuda_unavailable_reason

    if not cuda_unavailable_reason():
        pytest.skip("this machine has a CUDA driver")
    r = Rank(server, tmp_path)
    r.side.backend = CudaBackend()
    with caplog.at_level(logging.INFO, logger="vllm.hpkv"):
        r.side.register_kv_caches(r.kv)
    assert not r.side.enabled
    lines = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert lines == [f"hpkv disabled on this worker (rank 0): {cuda_unavailable_reason()}"]
    assert lines[0].endswith(
        "no libcuda (libcuda.so.1 could not be loaded: no NVIDIA driver on this machine)"
    )
    r.side.wait_for_save(HpkvMetadata(saves=[r.save_op("z", [1], "z")]))
    assert r.side.finished_saves({"z"}) == {"z"}  # vLLM still gets its blocks back
    r.close()


def test_without_cuda_ipc_copies_run_in_process_with_the_same_bytes(server, tmp_path, caplog):
    r = Rank(server, tmp_path, ipc=False)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.hpkv"):
            r.side.register_kv_caches(r.kv)
        assert r.side.enabled
        assert any("copies run in this process" in rec.getMessage() for rec in caplog.records)
        op = r.save_op("q1", [9, 10, 11], "q")
        expected = [r.block(b) for b in op.block_ids]
        r.side.wait_for_save(HpkvMetadata(saves=[op]))
        assert _until(lambda: r.side.finished_saves({"q1"})) == {"q1"}
        assert r.sched.lookup(r.ns.ns_id, op.keys)[0] == 3
        assert all(w["kind"] != "transfer" for w in r.sched.stats()["workers"])  # no transfer worker
        offsets = r.sched.pin(r.ns.ns_id, op.keys)
        # Blocks 1-3: block 0 is vLLM's null block, which a load refuses (a state group's hit)
        r.side.start_load_kv(HpkvMetadata(loads=[LoadOp("q2", op.keys, [1, 2, 3], offsets)]))
        assert r.side.take_load_errors() == set()
        assert [r.block(b) for b in (1, 2, 3)] == expected
    finally:
        r.close()
