"""The compact key → (time, tag) map behind the journal writer and the evictor."""

from __future__ import annotations

import random

import pytest

from hpkv.engine.storage import keytimes
from hpkv.engine.storage.keytimes import KeyTimes


@pytest.fixture(autouse=True)
def small_merges(monkeypatch):
    monkeypatch.setattr(keytimes, "MERGE_MIN", 8)  # merges, DEAD slots and the dict all exercised


def test_it_behaves_like_a_dict_of_keys_to_time_and_tag():
    rng = random.Random(1)
    pool = [bytes(16), b"\x01" + bytes(15), bytes(15) + b"\x01"] + [rng.randbytes(16) for _ in range(60)]
    kt, ref = KeyTimes(), {}
    for step in range(3000):
        key = rng.choice(pool)
        op = rng.random()
        if op < 0.5:
            kt.put(key, step, step % 7)
            ref[key] = (step, step % 7)
        elif op < 0.8:
            assert kt.remove(key) == (ref.pop(key, None) is not None)
        elif op < 0.9:
            keys = rng.sample(pool, 5)
            kt.put_many(b"".join(keys), step, 3)
            ref.update((k, (step, 3)) for k in keys)
        else:
            keys = rng.sample(pool, 6)
            assert kt.missing(b"".join(keys)) == b"".join(k for k in keys if k not in ref)
        assert kt.get(key) == ref.get(key) and len(kt) == len(ref)
    want = sorted((t, k, g) for k, (t, g) in ref.items())
    oldest = kt.oldest(10**6)  # (keys put together tie: any order among them)
    assert sorted(oldest) == want and [t for t, _, _ in oldest] == [t for t, _, _ in want]
    assert [t for t, _, _ in kt.oldest(5)] == [t for t, _, _ in want[:5]]
    keys, times, tags = kt.by_time()
    raw = keys.tobytes()  # (an S16 item alone loses its trailing zero bytes: read the array whole)
    assert [
        (int(t), raw[16 * i : 16 * i + 16], int(g)) for i, (t, g) in enumerate(zip(times, tags, strict=True))
    ] == oldest


def test_keys_that_end_in_zero_bytes_are_kept_whole():
    kt = KeyTimes()
    a, b = bytes(16), bytes(15) + b"\x02"
    kt.put(a, 1, 0)
    kt.put_many(b, 2, 1)
    assert kt.oldest(2) == [(1, a, 0), (2, b, 1)] and a in kt and bytes(15) + b"\x01" not in kt
