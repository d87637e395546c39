"""Batched block copy (native/copy.c via hpkv.transfer_workers.copy): byte-exact round trips for
the three KV-cache layouts, both store paths (cached memcpy and streaming), error
handling that copies nothing."""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest

from hpkv.transfer_workers import copy as copy_module
from hpkv.transfer_workers.copy import BlockCopier, BlockIndexError, BlockLayout, set_nt_threshold


@pytest.fixture(params=["cached", "streaming"])
def store_path(request):
    # 0 forces streaming stores for every batch; 2**63 never uses them.
    prev = set_nt_threshold(0 if request.param == "streaming" else 1 << 63)
    yield request.param
    set_nt_threshold(prev)


def _random(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


class Cache:
    """A device KV cache plus a reference accessor for page (block, layer)."""

    def __init__(self, kind: str, rng: np.random.Generator, L: int, NB: int, page: int):
        self.kind, self.L, self.NB, self.page = kind, L, NB, page
        if kind == "per_layer":
            # vLLM-like [num_blocks, heads, block, 2*head] float16 per layer
            assert page % 2 == 0
            self.arrays = [
                _random(rng, NB * page).view(np.float16).reshape(NB, 1, page // 2, 1) for _ in range(L)
            ]
            self.layout = BlockLayout.from_tensors(self.arrays)
            self.page_of = lambda b, ly: self.arrays[ly][b].view(np.uint8).reshape(-1)
        elif kind == "block_outermost":
            self.buf = _random(rng, NB * L * page)
            self.layout = BlockLayout.block_outermost(self.buf, L, NB, page)
            self.page_of = lambda b, ly: self.buf[(b * L + ly) * page : (b * L + ly + 1) * page]
        elif kind == "padded":
            # pages padded to a stride that is not a multiple of 64, base off by 3 bytes:
            # exercises the head/tail handling of the streaming path
            stride = page + 67
            self.raw = [_random(rng, NB * stride + 3) for _ in range(L)]
            self.views = [r[3:].reshape(NB, stride)[:, :page] for r in self.raw]
            self.layout = BlockLayout.from_tensors(self.views)
            assert self.layout.block_stride == stride
            self.page_of = lambda b, ly: self.views[ly][b]
        else:
            raise AssertionError(kind)

    def snapshot(self) -> list[np.ndarray]:
        src = {
            "per_layer": lambda: self.arrays,
            "block_outermost": lambda: [self.buf],
            "padded": lambda: self.raw,
        }[self.kind]()
        return [a.copy() for a in src]

    def fill(self, rng: np.random.Generator) -> None:
        for b in range(self.NB):
            for ly in range(self.L):
                self.page_of(b, ly)[...] = _random(rng, self.page)


@pytest.mark.parametrize("kind", ["per_layer", "block_outermost", "padded"])
@pytest.mark.parametrize("page", [1024, 4096 + 64, 16384])
def test_round_trip(kind: str, page: int, store_path: str) -> None:
    rng = np.random.default_rng(page + len(kind))
    L, NB, NS = 3, 24, 20
    cache = Cache(kind, rng, L, NB, page)
    slot_stride = cache.layout.slot_bytes + 192  # padded slots: padding must stay untouched
    pool = _random(rng, NS * slot_stride)
    pool_before = pool.copy()
    copier = BlockCopier(cache.layout, pool, slot_stride, NS)

    n = 17
    blocks = rng.permutation(NB)[:n].astype(np.int64)
    slots = rng.permutation(NS)[:n].astype(np.int64)
    copier.save(blocks, slots)

    used = np.zeros(NS, bool)
    used[slots] = True
    for b, s in zip(blocks, slots, strict=False):
        expect = np.concatenate([cache.page_of(b, ly) for ly in range(L)])
        got = pool[s * slot_stride : s * slot_stride + cache.layout.slot_bytes]
        np.testing.assert_array_equal(got, expect)
    # slot padding and untouched slots keep their bytes
    p2 = pool.reshape(NS, slot_stride)
    b2 = pool_before.reshape(NS, slot_stride)
    np.testing.assert_array_equal(p2[:, cache.layout.slot_bytes :], b2[:, cache.layout.slot_bytes :])
    np.testing.assert_array_equal(p2[~used], b2[~used])

    # Load into other blocks (a different permutation) after scrambling the cache.
    saved = {
        int(b): pool[s * slot_stride : s * slot_stride + cache.layout.slot_bytes].copy()
        for b, s in zip(blocks, slots, strict=False)
    }
    cache.fill(rng)
    before = cache.snapshot()
    targets = rng.permutation(NB)[:n].astype(np.int64)
    order = rng.permutation(n)
    copier.load(targets, slots[order])
    for t, src_block in zip(targets, blocks[order], strict=False):
        got = np.concatenate([cache.page_of(t, ly) for ly in range(L)])
        np.testing.assert_array_equal(got, saved[int(src_block)])
    # blocks not targeted, and (padded layout) the padding between pages, are unchanged
    untouched = np.setdiff1d(np.arange(NB), targets)
    after = cache.snapshot()
    if kind == "padded":
        for a, bf in zip(after, before, strict=False):
            pad = a[3:].reshape(NB, -1)[:, page:]
            np.testing.assert_array_equal(pad, bf[3:].reshape(NB, -1)[:, page:])
    for a, bf in zip(after, before, strict=False):
        if kind == "per_layer":
            np.testing.assert_array_equal(a[untouched], bf[untouched])
        elif kind == "block_outermost":
            np.testing.assert_array_equal(a.reshape(NB, -1)[untouched], bf.reshape(NB, -1)[untouched])
        else:
            np.testing.assert_array_equal(a[3:].reshape(NB, -1)[untouched], bf[3:].reshape(NB, -1)[untouched])


def test_lists_and_other_int_dtypes() -> None:
    rng = np.random.default_rng(7)
    cache = Cache("block_outermost", rng, 2, 8, 256)
    pool = np.zeros((8, cache.layout.slot_bytes), np.uint8)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, 8)
    copier.save([3, 5], np.array([1, 0], np.int32))
    np.testing.assert_array_equal(pool[1], cache.buf.reshape(8, -1)[3])
    np.testing.assert_array_equal(pool[0], cache.buf.reshape(8, -1)[5])
    # strided and big-endian index arrays are converted, not misread
    copier.save(np.arange(8, dtype=np.int64)[::4], np.array([6, 7], ">i8"))
    np.testing.assert_array_equal(pool[6], cache.buf.reshape(8, -1)[0])
    np.testing.assert_array_equal(pool[7], cache.buf.reshape(8, -1)[4])
    with pytest.raises(TypeError, match="integers"):
        copier.save(np.array([1.0]), [0])


@pytest.mark.parametrize("kind", ["per_layer", "padded"])
def test_a_large_save_split_over_threads_copies_the_same_bytes(kind, store_path, monkeypatch) -> None:
    monkeypatch.setattr(copy_module, "SPLIT_MIN_BYTES", 1)
    rng = np.random.default_rng(6)
    L, NB, NS, n = 3, 40, 36, 31
    cache = Cache(kind, rng, L, NB, 4096 + 64)
    pool = _random(rng, NS * cache.layout.slot_bytes)
    before = pool.copy().reshape(NS, -1)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, NS)
    sources = rng.permutation(NB)[:n].astype(np.int64)
    slots = rng.permutation(NS)[:n].astype(np.int64)
    copier.save(sources, slots, threads=3)
    for b, slot in zip(sources, slots, strict=True):
        np.testing.assert_array_equal(
            pool.reshape(NS, -1)[slot], np.concatenate([cache.page_of(b, ly) for ly in range(L)])
        )
    untouched = np.setdiff1d(np.arange(NS), slots)
    np.testing.assert_array_equal(pool.reshape(NS, -1)[untouched], before[untouched])
    assert copier._helper_threads == 2


@pytest.mark.parametrize("kind", ["per_layer", "padded"])
def test_a_large_load_split_over_threads_copies_the_same_bytes(kind, store_path, monkeypatch) -> None:
    monkeypatch.setattr(copy_module, "SPLIT_MIN_BYTES", 1)  # split even this small batch
    rng = np.random.default_rng(5)
    L, NB, NS, n = 3, 40, 36, 31
    cache = Cache(kind, rng, L, NB, 4096 + 64)
    pool = _random(rng, NS * cache.layout.slot_bytes)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, NS)
    targets = rng.permutation(NB)[:n].astype(np.int64)
    slots = rng.permutation(NS)[:n].astype(np.int64)
    untouched = np.setdiff1d(np.arange(NB), targets)
    before = [np.concatenate([cache.page_of(b, ly) for ly in range(L)]) for b in untouched]
    copier.load(targets, slots, threads=3)
    for t, slot in zip(targets, slots, strict=True):
        got = np.concatenate([cache.page_of(t, ly) for ly in range(L)])
        np.testing.assert_array_equal(got, pool.reshape(NS, -1)[slot])
    for b, was in zip(untouched, before, strict=True):
        np.testing.assert_array_equal(np.concatenate([cache.page_of(b, ly) for ly in range(L)]), was)
    assert copier._helper_threads == 2, "the calling thread copies one part itself"


def test_a_thread_slowed_by_a_busy_cpu_copies_fewer_chunks_of_a_split_load(monkeypatch) -> None:
    # The chunks of a split copy are taken in turn: when the calling thread shares its CPU
    # with a busy engine thread, the helper takes over the chunks it does not get to.
    monkeypatch.setattr(copy_module, "SPLIT_MIN_BYTES", 1)
    rng = np.random.default_rng(8)
    L, NB, n = 2, 16, 16
    cache = Cache("per_layer", rng, L, NB, 4096)
    pool = _random(rng, n * cache.layout.slot_bytes)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, n)
    caller = threading.get_ident()
    copied_by: dict[int, int] = {}
    real_run = copier._run
    helper_started = threading.Event()

    def run(b, s, direction):
        if threading.get_ident() == caller:
            assert helper_started.wait(10), "the helper thread never took a chunk"
            time.sleep(0.05)  # the caller's CPU is busy
        else:
            helper_started.set()
        copied_by[threading.get_ident()] = copied_by.get(threading.get_ident(), 0) + len(b)
        real_run(b, s, direction)

    monkeypatch.setattr(copier, "_run", run)
    targets = rng.permutation(NB).astype(np.int64)
    copier.load(targets, np.arange(n), threads=2)
    for t, slot in zip(targets, range(n), strict=True):
        got = np.concatenate([cache.page_of(t, ly) for ly in range(L)])
        np.testing.assert_array_equal(got, pool.reshape(n, -1)[slot])
    assert sum(copied_by.values()) == n
    helper = next(t for t in copied_by if t != caller)
    assert copied_by[helper] > copied_by.get(caller, 0), copied_by


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to")
def test_the_helpers_of_a_split_copy_run_on_the_cpus_given_to_them(monkeypatch) -> None:
    # Next to a sched_yield busy-poller the scheduler stacks unpinned copy threads on one
    # CPU; each thread gets a CPU set of its own instead.
    monkeypatch.setattr(copy_module, "SPLIT_MIN_BYTES", 1)
    cpus = sorted(os.sched_getaffinity(0))
    groups = [{cpus[0]}, {cpus[1]}, set(cpus[2:]) or {cpus[0]}]
    rng = np.random.default_rng(9)
    cache = Cache("per_layer", rng, 2, 16, 4096)
    pool = _random(rng, 16 * cache.layout.slot_bytes)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, 16, thread_cpus=groups)
    caller = threading.get_ident()
    seen: dict[int, set[int]] = {}
    real_run = copier._run
    all_started = threading.Barrier(3, timeout=10)  # every thread takes a chunk

    def run(b, s, direction):
        me = threading.get_ident()
        if me not in seen:
            seen[me] = os.sched_getaffinity(0)
            all_started.wait()
        real_run(b, s, direction)

    monkeypatch.setattr(copier, "_run", run)
    copier.load(np.arange(16), np.arange(16), threads=3)
    helpers = sorted(map(frozenset, (cpus_ for t, cpus_ in seen.items() if t != caller)), key=sorted)
    assert helpers == sorted(map(frozenset, groups[1:]), key=sorted)
    assert seen[caller] == os.sched_getaffinity(0), "the caller's CPUs are the caller's business"


@pytest.mark.parametrize("direction", ["save", "load", "split_save", "split_load"])
@pytest.mark.parametrize(
    "bad_blocks,bad_slots,which,pos,value",
    [
        ([0, 1, 2, 8], [0, 1, 2, 3], "dev_blocks", 3, 8),
        ([0, 1, -1, 2], [0, 1, 2, 3], "dev_blocks", 2, -1),
        ([0, 1, 2, 3], [0, 1, 2, 4], "slots", 3, 4),
        ([0, 1, 2, 3], [-5, 1, 2, 3], "slots", 0, -5),
        ([0, 99, 2, 3], [0, 1, 77, 3], "dev_blocks", 1, 99),  # first bad pair wins
    ],
)
def test_bad_index_copies_nothing(
    direction, bad_blocks, bad_slots, which, pos, value, store_path, monkeypatch
) -> None:
    monkeypatch.setattr(copy_module, "SPLIT_MIN_BYTES", 1)
    rng = np.random.default_rng(11)
    cache = Cache("per_layer", rng, 2, 8, 2048)
    pool = _random(rng, 4 * cache.layout.slot_bytes)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, 4)
    dev_before, pool_before = cache.snapshot(), pool.copy()
    with pytest.raises(BlockIndexError) as ei:
        b, s = np.array(bad_blocks, np.int64), np.array(bad_slots, np.int64)
        if direction.startswith("split_"):
            getattr(copier, direction.removeprefix("split_"))(b, s, threads=4)
        else:
            getattr(copier, direction)(b, s)
    err = ei.value
    assert (err.which, err.position, err.value) == (which, pos, value)
    assert f"{which}[{pos}] = {value}" in str(err) and "nothing" in str(err)
    np.testing.assert_array_equal(pool, pool_before)
    for a, b in zip(cache.snapshot(), dev_before, strict=False):
        np.testing.assert_array_equal(a, b)


def test_empty_batch_and_length_mismatch() -> None:
    rng = np.random.default_rng(3)
    cache = Cache("block_outermost", rng, 2, 4, 128)
    pool = np.zeros(4 * cache.layout.slot_bytes, np.uint8)
    copier = BlockCopier(cache.layout, pool, cache.layout.slot_bytes, 4)
    copier.save([], [])
    copier.load(np.empty(0, np.int64), np.empty(0, np.int64))
    assert not pool.any()
    with pytest.raises(ValueError, match="pair up"):
        copier.save([0, 1], [0])


def test_pool_as_mmap_and_address() -> None:
    rng = np.random.default_rng(5)
    cache = Cache("per_layer", rng, 4, 6, 512)
    sb = cache.layout.slot_bytes
    m = mmap.mmap(-1, 6 * sb)
    copier = BlockCopier(cache.layout, m, sb, 6)
    copier.save([5, 0], [0, 5])
    np.testing.assert_array_equal(
        np.frombuffer(m, np.uint8, sb, 0), np.concatenate([cache.page_of(5, ly) for ly in range(4)])
    )
    with pytest.raises(BufferError):  # the copier pins the mapping: no use-after-unmap
        m.close()
    del copier
    m.close()

    pool = np.zeros(6 * sb, np.uint8)
    BlockCopier(cache.layout, pool.__array_interface__["data"][0], sb, 6).save([1], [2])
    np.testing.assert_array_equal(
        pool[2 * sb : 3 * sb], np.concatenate([cache.page_of(1, ly) for ly in range(4)])
    )


def test_layout_validation() -> None:
    a = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="same geometry"):
        BlockLayout.from_tensors([a, np.zeros((5, 64), np.uint8)])
    with pytest.raises(ValueError, match="dense byte range"):
        BlockLayout.from_tensors([np.zeros((4, 64, 2), np.uint8)[:, ::2]])
    with pytest.raises(ValueError, match="overlap"):
        BlockLayout(layer_bases=(4096,), block_stride=32, page_bytes=64, num_blocks=2)
    with pytest.raises(ValueError, match="at least one layer"):
        BlockLayout(layer_bases=(), block_stride=64, page_bytes=64, num_blocks=2)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((4, 64), np.uint8)
        ro.flags.writeable = False
        BlockLayout.from_tensors([ro])
    with pytest.raises(ValueError, match="need"):
        BlockLayout.block_outermost(np.zeros(100, np.uint8), 2, 4, 16)
    with pytest.raises(TypeError):
        BlockLayout.from_tensors([[1, 2, 3]])
    # permuted inner dims (vLLM HND view of an NHD buffer) are one dense range
    phys = np.zeros((4, 16, 2, 8), np.float16)
    lay = BlockLayout.from_tensors([phys.transpose(0, 2, 1, 3)])
    assert (lay.page_bytes, lay.block_stride, lay.slot_bytes) == (512, 512, 512)

    good = BlockLayout.from_tensors([a, np.zeros((4, 64), np.uint8)])
    assert good.num_layers == 2 and good.slot_bytes == 128 and good.num_blocks == 4
    with pytest.raises(ValueError, match="slot_stride"):
        BlockCopier(good, np.zeros(1024, np.uint8), 100, 4)
    with pytest.raises(ValueError, match="pool holds"):
        BlockCopier(good, np.zeros(1024, np.uint8), 128, 9)
    with pytest.raises(ValueError, match="read-only"):
        BlockCopier(good, bytes(1024), 128, 4)


def test_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    L, NB = 2, 6
    # per layer [num_blocks, heads, block, 2*head], padded blocks via a strided view
    raw = [torch.randint(-128, 127, (NB, 2 * 16 * 32 + 32), dtype=torch.int8, generator=g) for _ in range(L)]
    layers = [
        torch.as_strided(r.view(torch.bfloat16), (NB, 2, 16, 16), (r.shape[1] // 2, 256, 16, 1)) for r in raw
    ]
    layout = BlockLayout.from_tensors(layers)
    assert (layout.page_bytes, layout.block_stride) == (1024, 1056)
    pool = torch.zeros(NB * layout.slot_bytes, dtype=torch.uint8)
    BlockCopier(layout, pool, layout.slot_bytes, NB).save([4, 1], [0, 3])
    p = pool.view(NB, L, 1024)
    for ly in range(L):
        assert torch.equal(p[0, ly], raw[ly][4, :1024].view(torch.uint8))
        assert torch.equal(p[3, ly], raw[ly][1, :1024].view(torch.uint8))
