"""The native key table behaves like the dict it replaces, at any size."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpkv.engine.keytable import KeyTable

KEYS = [os.urandom(16) for _ in range(64)]
ops = st.lists(
    st.tuples(st.sampled_from(["set", "pop", "get"]), st.integers(0, 63), st.integers(1, 2)), max_size=400
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_matches_a_dict(seq):
    t, ref = KeyTable(16), {}
    for op, i, v in seq:
        k = KEYS[i]
        if op == "set":
            t.set(k, 3, v)
            ref[k] = v
        elif op == "pop":
            assert t.pop(k) == ref.pop(k, None)
        else:
            assert t.get(k) == ref.get(k)
        assert len(t) == len(ref)
    present = [k for k in KEYS if k in ref]
    assert t.lookup(3, present) == (len(present), [ref[k] for k in present])
    out = bytearray(len(KEYS))
    assert t.each(3, b"".join(KEYS), len(KEYS), out) == len(present)
    assert list(out) == [ref.get(k, 0) for k in KEYS]
    assert t.each(4, b"".join(KEYS), len(KEYS), out) == 0 and not any(out), "another namespace's keys"


def test_prefix_stops_at_the_first_missing_key_and_survives_growth():
    t = KeyTable(16)
    keys = [os.urandom(16) for _ in range(50_000)]
    for i, k in enumerate(keys):
        t.set(k, 0, 1 + i % 2)
    for k in keys[::2]:
        t.pop(k)
    for k in keys[::4]:
        t.set(k, 0, 2)  # tombstones reused
    probe = keys[:8]
    n, tiers = t.lookup(0, probe)
    assert n == 2 and tiers == [2, 2]  # keys[0] set again, keys[1] kept, keys[2] removed
    buf, out = b"".join(keys[4:12:4] + keys[2:3]), bytearray(3)
    assert t.prefix(0, buf, 3, out) == 2 and list(out[:2]) == [2, 2]
    assert len(t) == 25_000 + 12_500


def test_a_key_is_present_only_to_the_namespace_that_owns_it():
    t = KeyTable(16)
    a, b, c = (os.urandom(16) for _ in range(3))
    t.set(a, 5, 1)
    t.set(b, 5, 2)
    t.set(c, 6, 1)
    assert t.lookup(5, [a, b, c]) == (2, [1, 2]), "c is namespace 6's: the prefix ends there"
    assert t.lookup(6, [a]) == (0, []) and t.lookup(6, [c]) == (1, [1])
    assert t.get(a, ns=6) is None and t.get(a, ns=5) == 1 and t.get(a) == 1
    assert t.owner(c) == 6 and t.owner(os.urandom(16)) is None
    t.set(a, 6, 2)  # its owner changes only when the index says so
    assert t.lookup(6, [a, c]) == (2, [2, 1]) and t.lookup(5, [a]) == (0, [])


def test_namespace_ids_and_values_outside_the_packed_byte_are_refused():
    from hpkv.common.native import lib
    from hpkv.protocol.stats import MAX_NS

    t, k = KeyTable(16), os.urandom(16)
    for ns, v in ((MAX_NS, 1), (-1, 1), (0, 4), (0, 0)):
        with pytest.raises(ValueError):
            t.set(k, ns, v)
    assert lib.hpkv_keytable_set(t._t, k, MAX_NS, 1) == -2, "the C table packs ns ids below MAX_NS"
    assert lib.hpkv_keytable_set(t._t, k, MAX_NS - 1, 3) == 0 and t.get(k) == 3 and t.owner(k) == MAX_NS - 1
    assert len(t) == 1


def test_columns_follow_their_key_through_growth_and_reuse_of_tombstones():
    t = KeyTable(16, columns=True)
    keys = [os.urandom(16) for _ in range(20_000)]
    for i, k in enumerate(keys):
        t.set(k, i % 64, 1 + i % 3)
        assert t.set_recency(k, 1000 + i) and t.set_stamp(k, i)
    for k in keys[::3]:
        t.pop(k)
    assert t.capacity() >= len(keys) and len(t) == len(keys) - len(keys[::3])
    for i, k in enumerate(keys):
        want = (0, 0, 0, 0) if i % 3 == 0 else (1 + i % 3, i % 64, 1000 + i, i)
        assert t.columns(k) == want
    t.set(keys[0], 5, 2)
    assert t.columns(keys[0]) == (2, 5, 0, 0), "a key new to the table starts with zero columns"
    assert not t.set_recency(os.urandom(16), 1), "an absent key is not added"


def test_oldest_returns_the_least_recent_keys_with_a_flag_in_order():
    t = KeyTable(16, columns=True)
    keys = [os.urandom(16) for _ in range(3000)]
    recs = list(range(3000))
    random.Random(3).shuffle(recs)
    for k, r in zip(keys, recs, strict=True):
        t.set(k, 0, 1 if r % 2 == 0 else 2)
        t.set_recency(k, r)
    even = sorted((r, k) for k, r in zip(keys, recs, strict=True) if r % 2 == 0)
    assert t.oldest(1, 10) == [(k, r) for r, k in even[:10]]
    assert t.oldest(1, 10**6) == [(k, r) for r, k in even], "k above the entries: all of them"
    assert [r for _, r in t.oldest(3, 5)] == [0, 1, 2, 3, 4]


def test_select_finds_a_namespaces_keys_with_a_flag():
    t = KeyTable(16, columns=True)
    a = [os.urandom(16) for _ in range(100)]
    b = [os.urandom(16) for _ in range(50)]
    for k in a:
        t.set(k, 1, 1)
    for k in b:
        t.set(k, 2, 3)
    assert sorted(t.select(1, ns=1)) == sorted(a)
    assert sorted(t.select(2)) == sorted(b) and t.select(2, ns=1) == []
    assert len(t.select(1)) == 150


def test_a_table_without_columns_has_none():
    t = KeyTable(16)
    k = os.urandom(16)
    t.set(k, 0, 1)
    assert t.columns(k) == (0, 0, 0, 0) and not t.set_recency(k, 5) and t.oldest(1, 4) == []


def test_a_table_that_grows_step_by_step_answers_like_a_dict_throughout():
    """Growing moves the old slots a few per insert or removal: every key stays findable,
    with its columns, while it lives in the old arrays or the new ones."""
    rng = random.Random(11)
    t, ref = KeyTable(16, columns=True), {}
    pool = [os.urandom(16) for _ in range(6000)]
    checked_while_moving = 0
    for step in range(30_000):
        k = pool[rng.randrange(len(pool))]
        if rng.random() < 0.7:
            v = rng.randrange(1, 4)
            t.set(k, 7, v)
            if k not in ref:
                t.set_recency(k, step)
            ref[k] = (v, step if k not in ref else ref[k][1])
        elif t.pop(k) is not None:
            del ref[k]
        if step % 97 == 0:
            checked_while_moving += t.capacity() & (t.capacity() - 1) != 0  # old and new arrays
            assert len(t) == len(ref)
            probe = rng.sample(pool, 64)
            assert [t.columns(p)[:3] for p in probe] == [
                (*(ref[p][:1]), 7, ref[p][1]) if p in ref else (0, 0, 0) for p in probe
            ]
            oldest = sorted(ref, key=lambda x: ref[x][1])[:20]
            assert [key for key, _ in t.oldest(3, 20)] == oldest
            assert sorted(t.select(3, ns=7)) == sorted(ref)
    assert checked_while_moving, "no check ran while the table grew"
    for k in list(ref)[: len(ref) // 2]:
        t.pop(k)
    assert t.capacity() & (t.capacity() - 1) == 0, "the old arrays are gone once every slot moved"
