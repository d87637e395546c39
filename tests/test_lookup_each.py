"""A lookup that answers every key (``probe_each``, the LOOKUP call's FLAG_EACH): what a
sliding-window model's hit needs, in one call. Real hpkv server processes, DRAM and file tier,
including a lookup parked while the file tier stats keys another server wrote."""

from __future__ import annotations

import os
import time

import numpy as np
from test_storage import Writer

from hpkv.client import connect
from hpkv.engine.storage.catalog import VERIFY_TTL_S
from hpkv.engine.storage.journal import Adds, JournalWriter
from hpkv.io_workers import kvfile
from hpkv.io_workers.tree import StorageTree
from hpkv.protocol.wire import Tier
from hpkv.testing.server import private_env, running

D, S = int(Tier.DRAM), int(Tier.STORAGE)


def test_each_key_is_answered_in_the_pool_and_a_prefix_lookup_is_unchanged(tmp_path):
    with running(private_env(pool_size="64m")) as srv:
        w = Writer(srv, shard=4096)
        keys = w.keys(range(12))
        present = [0, 1, 2, 5, 6, 9, 11]
        w.put([keys[i] for i in present])
        hit, tiers, unconfirmed = w.c.probe_each(w.ns.ns_id, keys)
        assert tiers == [D if i in present else 0 for i in range(12)]
        assert (hit, unconfirmed) == (3, False)
        assert w.c.lookup(w.ns.ns_id, keys) == (3, [D] * 3), "the prefix lookup still stops at a miss"
        assert w.c.probe_each(w.ns.ns_id, []) == (0, [], False)
        assert w.c.probe_each(w.ns.ns_id, keys[:3]) == (3, [D] * 3, False)
        (ns,) = w.c.stats()["namespaces"]
        assert ns["hits_dram"] == 7 + 3 + 3, "every present key counted as a hit"
        w.close()


def test_each_key_is_answered_from_the_files_and_after_a_restart(tmp_path):
    """Storage hits after the leading prefix are checked as the leading ones are (a file
    deleted from outside is no hit); unknown keys after it are not stat-ed. After a restart
    the server knows the files from its journals, and checks them on their first hit."""
    n = 300
    absent = {3, 4, 10, 276, n - 1}
    # A lookup bound far above a stat's cost: this is about what the stats find, not how fast.
    slow_ok = {"HPKV_STORAGE_LOOKUP_WAIT_MS": "5000"}
    with running(private_env(pool_size="64m", storage=str(tmp_path), **slow_ok)) as srv:
        w = Writer(srv, shard=4096)
        keys = w.keys(range(n))
        stored = [k for i, k in enumerate(keys) if i not in absent]
        w.put(stored)
        w.wait_spilled(len(stored))
        assert w.c.clear(w.ns.ns_id) == len(stored)
        want = [0 if i in absent else S for i in range(n)]
        assert w.c.probe_each(w.ns.ns_id, keys) == (3, want, False)
        w.c.promote(w.ns.ns_id, keys[:2] + keys[100:101])  # back in DRAM
        w.c.unpin(w.ns.ns_id, keys[:2] + keys[100:101])
        want[:2] = [D, D]
        want[100] = D
        assert w.c.probe_each(w.ns.ns_id, keys) == (3, want, False)
        os.unlink(w.path(keys[200]))  # deleted from outside: no hit once checked again
        time.sleep(VERIFY_TTL_S + 0.2)
        want[200] = 0
        assert w.c.probe_each(w.ns.ns_id, keys) == (3, want, False)
        w.close()
    with running(private_env(pool_size="64m", storage=str(tmp_path), **slow_ok)) as srv:
        c = connect(srv.cfg, spawn=False, call_timeout=30.0)
        ns = c.attach_namespace(w.fp, 1, 4096, name="storage-test")
        # the journals' blocks are checked on their first hit: asked again until they are settled
        assert c.settled_lookup(ns.ns_id, keys, 30.0, each=True) == (3, [t and S for t in want])
        c.close()


def test_each_key_is_answered_while_the_journals_are_still_read(tmp_path):
    """Right after a restart the server is still reading the journals: a key past the leading
    prefix that the catalog has not reached yet may be on storage, so it is stat-ed as the
    prefix's keys are, never answered as a confirmed miss (a sliding-window model would
    recompute what is on disk). Another node's long journal, older than this node's, is read
    first, so this node's blocks are learned last."""
    n = 40
    absent = {3, 20}
    with running(private_env(pool_size="64m", storage=str(tmp_path))) as srv:
        w = Writer(srv, shard=4096)
        keys = w.keys(range(n))
        stored = [k for i, k in enumerate(keys) if i not in absent]
        w.put(stored)
        w.wait_spilled(len(stored))
        w.close()
    others = np.random.default_rng(7).bytes(16 * 400_000)  # blocks of a node that shares the directory
    tree = StorageTree.open(str(tmp_path))
    journal = JournalWriter(tree, w.fp, "other-node")
    journal.append([journal.apply_adds(Adds(1, 1, others, kvfile.file_size(4096)))])
    with running(private_env(pool_size="64m", storage=str(tmp_path))) as srv:
        c = connect(srv.cfg, spawn=False, call_timeout=30.0)
        ns = c.attach_namespace(w.fp, 1, 4096, name="storage-test")
        # the journals take about a second to read here: a key not reached yet is asked again
        assert c.settled_lookup(ns.ns_id, keys, 30.0, each=True) == (
            3,
            [0 if i in absent else S for i in range(n)],
        )
        c.close()
