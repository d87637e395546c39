"""The CPU worker side places vLLM's KV cache in a shared-memory file the transfer worker maps,
like for like with vLLM's own allocation: every page is mapped at start-up (torch.zeros
touches them all; hpkv maps with MAP_POPULATE), not faulted in during the first prefills."""

from __future__ import annotations

import os

import torch

from hpkv.connectors.vllm.worker import WorkerSide
from hpkv.testing.memory import resident_bytes_of_mapping

MIB = 1 << 20


def _worker(pool_dir: str) -> WorkerSide:
    def never(_spec):
        raise AssertionError("placement does not connect")

    return WorkerSide(None, 0, pool_dir, "cpu", open_store=never)  # type: ignore[arg-type]


def test_the_kv_cache_lands_in_the_pool_directory_with_every_page_mapped(tmp_path):
    ws = _worker(str(tmp_path))
    real_zeros = torch.zeros
    with ws.mem_pool_context():
        kv = torch.zeros(64 * MIB, dtype=torch.int8)  # vLLM's one allocation of the KV cache
        other = torch.zeros(4, dtype=torch.float32)  # anything else stays ordinary memory
    (name,) = os.listdir(tmp_path)
    assert ws._kv_file == str(tmp_path / name) and os.path.getsize(ws._kv_file) == 64 * MIB
    assert resident_bytes_of_mapping(kv.data_ptr()) == 64 * MIB, "page tables filled at allocation"
    assert kv.data_ptr() == ws._kv_base and not kv.any()
    assert torch.zeros is real_zeros and other.sum() == 0
    kv[::4096] = 1
    with open(ws._kv_file, "rb") as f:
        assert f.read(1) == b"\x01", "the transfer worker sees what vLLM writes"


def test_a_pool_directory_that_cannot_be_made_leaves_vllms_own_allocation_and_disables_hpkv(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    ws = _worker(str(tmp_path / "a-file" / "pool"))  # not a directory, even for root
    with ws.mem_pool_context():
        kv = torch.zeros(MIB, dtype=torch.int8)
    assert kv.numel() == MIB and not kv.any() and ws._kv_file is None
    assert ws.enabled is False
    assert "cannot place the 1048576-byte KV cache in shared memory" in caplog.text
