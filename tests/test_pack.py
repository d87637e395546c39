"""``hpkv export`` / ``hpkv import``: a namespace's KV files as one checksummed pack.

Real files throughout; the round trip and the running-server import use real hpkv servers
(blocks saved into the pool by a client and spilled by the IO workers, as in test_storage).
Packs for the refusal tests are made from KV files written in process (no server needed).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_storage import FP, Writer, running, verify_file  # the storage tests' real-process helpers

from hpkv.engine.storage import pack
from hpkv.engine.storage.journal import JournalReader
from hpkv.io_workers import kvfile
from hpkv.io_workers.checksum import crc32c
from hpkv.io_workers.kvfile import BlockId, KvFileIO
from hpkv.protocol.keys import block_keys, namespace_fingerprint
from hpkv.testing.server import private_env, wait_for

SHARD = 20_000
WORLD = 2


def hpkv(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkv", *args], env=env, capture_output=True, text=True, timeout=120
    )


def private_dir(path: Path) -> str:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(path)


def write_blocks(
    root: str, fp: str, n: int, world: int = WORLD, shard: int = SHARD
) -> dict[bytes, list[bytes]]:
    """KV files of ``n`` random blocks under ``root``, written by the format module."""
    mm = mmap.mmap(-1, kvfile.align_up(shard))
    buf = memoryview(mm)
    io = KvFileIO(root, buf, o_direct=False)
    rng = np.random.default_rng(n)
    data: dict[bytes, list[bytes]] = {}
    try:
        for k in block_keys(fp, [b"blk-%d" % i for i in range(n)]):
            data[k] = []
            for r in range(world):
                payload = rng.integers(0, 256, shard, dtype=np.uint8).tobytes()
                buf[:shard] = payload
                io.write(fp, BlockId(bytes.fromhex(fp), k, r, world), 0, shard)
                data[k].append(payload)
    finally:
        buf.release()
        io.close()
        mm.close()
    return data


def kv_files(root: str) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and p.name.endswith(".kv"))


def anything_under(root: str) -> list[Path]:
    return sorted(Path(root).rglob("*")) if os.path.exists(root) else []


@pytest.fixture
def made_pack(tmp_path):
    """(pack path, its source storage, fingerprint, data) of 4 blocks, 2 ranks."""
    src = private_dir(tmp_path / "src")
    fp = namespace_fingerprint({"model": "pack-test"})
    data = write_blocks(src, fp, 4)
    out = str(tmp_path / "ns.pack")
    report = pack.export_pack(src, fp, out)
    assert (report.blocks, report.files) == (4, 8)
    return out, src, fp, data


# ------------------------------------------------------------------ the format
def test_pack_is_head_kv_files_manifest_tail_as_documented(made_pack):
    out, src, fp, data = made_pack
    raw = Path(out).read_bytes()
    file_bytes = kvfile.file_size(SHARD)
    assert raw[:8] == pack.PACK_MAGIC and struct.unpack_from("<I", raw, 8)[0] == pack.PACK_VERSION
    magic, _, _, m_off, m_len, m_crc, _ = struct.unpack("<8sIIQQII24x", raw[-64:])
    assert magic == pack.TAIL_MAGIC and m_off == pack.HEAD_BYTES + 8 * file_bytes
    manifest = json.loads(raw[m_off : m_off + m_len])
    assert crc32c(raw[m_off : m_off + m_len]) == m_crc
    assert manifest["namespace"] == {
        "fingerprint": fp,
        "name": "",
        "world_size": WORLD,
        "shard_bytes": SHARD,
        "block_tokens": 0,
    }
    assert (manifest["blocks"], manifest["files"], manifest["bytes"]) == (4, 8, 8 * file_bytes)
    assert manifest["kv_format_version"] == 1 and manifest["checksum"] == "crc32c"
    # each file is the KV file byte for byte; its manifest CRC is the one its header carries
    for i, (keyhex, crcs) in enumerate(manifest["keys"]):
        key = bytes.fromhex(keyhex)
        for r in range(WORLD):
            at = pack.HEAD_BYTES + (i * WORLD + r) * file_bytes
            on_disk = Path(kvfile.file_path(src, fp, key, r)).read_bytes()
            assert raw[at : at + file_bytes] == on_disk
            assert crcs[r] == kvfile.unpack_header(memoryview(on_disk)).payload_crc == crc32c(data[key][r])
    assert os.stat(out).st_mode & 0o777 == 0o600, "a pack holds prompts' KV: private"


def test_export_leaves_out_incomplete_and_corrupt_blocks_and_says_so(tmp_path):
    src = private_dir(tmp_path / "src")
    fp = namespace_fingerprint({"model": "pack-skip"})
    data = write_blocks(src, fp, 5)
    keys = list(data)
    os.unlink(kvfile.file_path(src, fp, keys[0], 1))  # incomplete
    with open(kvfile.file_path(src, fp, keys[1], 0), "r+b") as f:  # corrupt payload
        f.seek(kvfile.HEADER_BYTES + 7)
        b = f.read(1)
        f.seek(kvfile.HEADER_BYTES + 7)
        f.write(bytes([b[0] ^ 0x40]))
    report = pack.export_pack(src, fp, str(tmp_path / "p.pack"))
    assert (report.blocks, report.skipped_incomplete, report.skipped_corrupt) == (3, 1, 1)
    assert "payload checksum mismatch" in " ".join(report.problems)
    assert os.path.exists(kvfile.file_path(src, fp, keys[1], 0)), "export never moves files"


def test_export_refuses_an_existing_pack_and_a_namespace_without_blocks(tmp_path, made_pack):
    out, src, fp, _ = made_pack
    with pytest.raises(FileExistsError):
        pack.export_pack(src, fp, out)
    with pytest.raises(pack.PackError, match="no complete block"):
        pack.export_pack(src, namespace_fingerprint({"model": "empty"}), str(tmp_path / "e.pack"))
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "no temporary pack left"


# ------------------------------------------------------------------ refusals: nothing written
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _rewrite_manifest(path: str, change) -> None:
    """Replace the manifest with ``change(manifest)``, with a correct CRC and tail: a pack whose
    checksums all hold but whose content is malformed."""
    raw = Path(path).read_bytes()
    _, _, _, m_off, m_len, _, _ = struct.unpack("<8sIIQQII24x", raw[-64:])
    doc = json.loads(raw[m_off : m_off + m_len])
    body = json.dumps(change(doc)).encode()
    Path(path).write_bytes(raw[:m_off] + body + pack._tail(m_off, len(body), crc32c(body)))


CORRUPTIONS = {
    "payload byte": lambda p, fb: _flip(p, pack.HEAD_BYTES + fb + kvfile.HEADER_BYTES + 100),
    "kv header byte": lambda p, fb: _flip(p, pack.HEAD_BYTES + 2 * fb + 40),
    "padding byte": lambda p, fb: _flip(p, pack.HEAD_BYTES + 3 * fb - 1),
    "manifest byte": lambda p, fb: _flip(p, os.path.getsize(p) - 80),
    "tail byte": lambda p, fb: _flip(p, os.path.getsize(p) - 30),
    "head magic": lambda p, fb: _flip(p, 0),
    "truncated": lambda p, fb: os.truncate(p, os.path.getsize(p) - 5000),
    "truncated to the head": lambda p, fb: os.truncate(p, 4096),
    "empty": lambda p, fb: os.truncate(p, 0),
    "a block swapped for another": lambda p, fb: _swap_files(p, fb),
    "world size 0": lambda p, fb: _rewrite_manifest(
        p, lambda d: {**d, "namespace": {**d["namespace"], "world_size": 0}}
    ),
    "a key listed twice": lambda p, fb: _rewrite_manifest(p, lambda d: {**d, "keys": [d["keys"][0]] * 4}),
    "a manifest crc off": lambda p, fb: _rewrite_manifest(
        p,
        lambda d: {
            **d,
            "keys": [[d["keys"][0][0], [d["keys"][0][1][0] ^ 1, d["keys"][0][1][1]]]] + d["keys"][1:],
        },
    ),
    "block count": lambda p, fb: _rewrite_manifest(p, lambda d: {**d, "blocks": 3}),
    "not json": lambda p, fb: _rewrite_raw_manifest(p, b"{not json"),
    "nested too deep": lambda p, fb: _rewrite_raw_manifest(p, b"[" * 100_000),
    "not utf-8": lambda p, fb: _rewrite_raw_manifest(p, b'{"format": "\xff\xfe"}'),
    "another kv format": lambda p, fb: _rewrite_manifest(p, lambda d: {**d, "kv_format_version": 2}),
    "a path as key": lambda p, fb: _rewrite_manifest(
        p, lambda d: {**d, "keys": [["../../../../etc/passwd", d["keys"][0][1]]] + d["keys"][1:]}
    ),
}


def _swap_files(path: str, fb: int) -> None:
    """Blocks 0 and 1 trade places: each file is valid, but not the one the manifest names."""
    raw = bytearray(Path(path).read_bytes())
    a, b = pack.HEAD_BYTES, pack.HEAD_BYTES + 2 * fb
    raw[a : a + 2 * fb], raw[b : b + 2 * fb] = raw[b : b + 2 * fb], raw[a : a + 2 * fb]
    Path(path).write_bytes(bytes(raw))


def _rewrite_raw_manifest(path: str, body: bytes) -> None:
    raw = Path(path).read_bytes()
    _, _, _, m_off, _, _, _ = struct.unpack("<8sIIQQII24x", raw[-64:])
    Path(path).write_bytes(raw[:m_off] + body + pack._tail(m_off, len(body), crc32c(body)))


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupt_or_malformed_pack_is_refused_and_writes_nothing(tmp_path, made_pack, how):
    out, _, _, _ = made_pack
    CORRUPTIONS[how](out, kvfile.file_size(SHARD))
    dest = str(tmp_path / "dest")
    with pytest.raises(pack.PackError):
        pack.import_pack(out, dest)
    assert anything_under(dest) == [], "not even the storage directory is made"


def test_a_corrupt_pack_is_refused_by_the_cli_with_the_reason(tmp_path, made_pack):
    out, _, _, _ = made_pack
    _flip(out, pack.HEAD_BYTES + 5 * kvfile.file_size(SHARD) + kvfile.HEADER_BYTES + 9)
    env = private_env(storage=str(tmp_path / "dest"))
    r = hpkv(env, "import", out)
    assert r.returncode == 1
    assert "import refused, nothing written" in r.stderr and "block 2" in r.stderr and "rank 1" in r.stderr
    assert "payload checksum mismatch" in r.stderr
    assert anything_under(str(tmp_path / "dest")) == []


def test_a_pack_for_another_namespace_is_refused_when_one_is_named(tmp_path, made_pack):
    out, _, fp, _ = made_pack
    other = namespace_fingerprint({"model": "another"})
    dest = str(tmp_path / "dest")
    env = private_env(storage=dest)
    r = hpkv(env, "import", "--namespace", other, out)
    assert r.returncode == 1
    assert f"holds namespace {fp}" in r.stderr and f"not {other}" in r.stderr
    assert anything_under(dest) == []
    r = hpkv(env, "import", "--namespace", fp, out)
    assert r.returncode == 0, r.stderr
    assert len(kv_files(dest)) == 8


def _model_dir(path: Path, hidden: int) -> str:
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": hidden})
    )
    return str(path)


def test_a_pack_for_another_model_is_refused_with_expect_model(tmp_path):
    src = private_dir(tmp_path / "src")
    fp = namespace_fingerprint({"model": "pack-model"})
    write_blocks(src, fp, 3)
    ours, theirs = _model_dir(tmp_path / "ours", 512), _model_dir(tmp_path / "theirs", 1024)
    env_src = private_env(storage=src)
    out = str(tmp_path / "m.pack")
    r = hpkv(env_src, "export", "--namespace", fp[:12], "--model", ours, out)
    assert r.returncode == 0, r.stderr
    dest = str(tmp_path / "dest")
    env = private_env(storage=dest)
    r = hpkv(env, "import", "--expect-model", theirs, out)
    assert r.returncode == 1 and "the pack is for another model" in r.stderr and ours in r.stderr
    assert anything_under(dest) == []
    assert hpkv(env, "import", "--expect-model", ours, out).returncode == 0
    assert len(kv_files(dest)) == 6
    # a pack that records no model cannot be checked against one: refused too
    bare = str(tmp_path / "bare.pack")
    assert hpkv(env_src, "export", "--namespace", fp, bare).returncode == 0
    r = hpkv(private_env(storage=str(tmp_path / "d2")), "import", "--expect-model", ours, bare)
    assert r.returncode == 1 and "exported without --model" in r.stderr


def test_import_refuses_a_storage_directory_others_can_write(tmp_path, made_pack):
    out, _, _, _ = made_pack
    dest = tmp_path / "open"
    dest.mkdir(mode=0o777)
    os.chmod(dest, 0o777)
    with pytest.raises(OSError, match="writable by its group or by others"):
        pack.import_pack(out, str(dest))
    assert anything_under(str(dest)) == []


# ------------------------------------------------------------------ --json and --dry-run
def test_json_output_of_export_and_import(tmp_path):
    src = private_dir(tmp_path / "src")
    fp = namespace_fingerprint({"model": "pack-json"})
    write_blocks(src, fp, 3)
    out = str(tmp_path / "j.pack")
    r = hpkv(private_env(storage=src), "export", "--namespace", fp, out, "--name", "sys-prompt", "--json")
    assert r.returncode == 0, r.stderr
    ex = json.loads(r.stdout)
    assert ex["namespace"]["name"] == "sys-prompt"
    assert ex["pack"] == out and (ex["blocks"], ex["files"]) == (3, 6) and ex["bytes"] == os.path.getsize(out)
    assert ex["namespace"]["fingerprint"] == fp and ex["server_pid"] is None
    assert ex["skipped"] == {"incomplete": 0, "corrupt": 0, "other": 0}
    dest = str(tmp_path / "dest")
    env = private_env(storage=dest)
    r = hpkv(env, "import", out, "--dry-run", "--json")
    dry = json.loads(r.stdout)
    assert r.returncode == 0 and dry["ok"] and dry["dry_run"] and dry["files_written"] == 0
    assert anything_under(dest) == [], "--dry-run writes nothing"
    r = hpkv(env, "import", out, "--namespace", fp[:12], "--json")
    im = json.loads(r.stdout)
    assert im["namespace"]["name"] == "sys-prompt", "the name is in the manifest"
    assert im["ok"] and (im["blocks"], im["files_written"], im["files_present"]) == (3, 6, 0)
    assert im["verified_bytes"] == 6 * kvfile.file_size(SHARD) and im["journal"].endswith(".log")
    again = json.loads(hpkv(env, "import", out, "--json").stdout)
    assert (again["files_written"], again["files_present"]) == (0, 6), "files already there are kept"
    _flip(out, 0)
    r = hpkv(env, "import", out, "--json")
    bad = json.loads(r.stdout)
    assert r.returncode == 1 and bad["ok"] is False and "not an hpkv pack" in bad["error"]


# ------------------------------------------------------------------ with real servers
def test_round_trip_gives_a_new_server_storage_hits_with_identical_bytes(tmp_path):
    a_dir, b_dir = private_dir(tmp_path / "a"), str(tmp_path / "b")
    out = str(tmp_path / "rt.pack")
    env_a = private_env(storage=a_dir)
    with running(env_a) as a:
        w = Writer(a, world=WORLD, shard=50_000)
        keys = w.keys(range(6))
        w.put(keys)
        w.wait_spilled(6 * WORLD)
        r = hpkv(env_a, "export", "--namespace", "storage-test", out, "--json")  # by the server's name
        assert r.returncode == 0, r.stderr
        ex = json.loads(r.stdout)
        assert ex["server_pid"] == a.proc.pid and "only in its DRAM pool" in ex["note"]
        assert ex["namespace"] == {
            "fingerprint": FP,
            "name": "storage-test",
            "world_size": WORLD,
            "shard_bytes": 50_000,
            "block_tokens": 0,
        }
        data = w.data
        w.close()
    env_b = private_env(storage=b_dir, HPKV_STORAGE_LOOKUP_WAIT_MS="5000")
    r = hpkv(env_b, "import", out)
    assert r.returncode == 0, r.stderr
    assert f"imported 6 block(s) of namespace {FP} (storage-test): 12 file(s) written" in r.stdout
    assert len(kv_files(b_dir)) == 12
    with running(env_b) as b:
        w = Writer(b, world=WORLD, shard=50_000)
        w.data = data
        # (its first lookup may be unconfirmed while the namespace's files are being learned:
        # the engine asks again, as settled_lookup does)
        assert w.c.settled_lookup(w.ns.ns_id, keys, 10.0) == (6, [2] * 6), "storage hits on the new server"
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))  # byte for byte what was saved on a
        s = w.storage()
        assert s["files"] == 12 and s["io_errors"] == 0 and s["quarantined"] == 0
        w.close()
        assert "from the journals" in b.log() and "no scan" in b.log(), "attached from the import's journal"


def test_import_into_a_running_server_is_found_by_its_lookups(tmp_path, made_pack):
    out, _, fp, data = made_pack
    dest = private_dir(tmp_path / "live")
    env = private_env(storage=dest, HPKV_STORAGE_JOURNAL_POLL="0.2")
    with running(env) as srv:
        w = Writer(srv, world=WORLD, shard=SHARD, fp=fp)
        keys = list(data)
        assert w.c.lookup(w.ns.ns_id, keys) == (0, [])
        r = hpkv(env, "import", out)
        assert r.returncode == 0, r.stderr
        assert f"server {srv.proc.pid} finds them" in r.stdout
        # the server's journal poll adds them to its catalog, with no lookup asking
        wait_for(lambda: w.storage()["files"] == 4 * WORLD, 10, "the import's journal read")
        assert w.c.lookup(w.ns.ns_id, keys) == (4, [2] * 4)
        w.data = data
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
        w.close()
    got = JournalReader(_tree(dest), fp).poll()
    recs = got[pack.import_node() + ".log"]
    assert {r.key for r in recs} == set(keys), "the import's own journal lists the blocks"


def _tree(root: str):
    from hpkv.io_workers.tree import StorageTree

    return StorageTree.open(root)


def test_an_import_killed_midway_leaves_only_complete_valid_kv_files(tmp_path):
    src = private_dir(tmp_path / "src")
    fp = namespace_fingerprint({"model": "pack-kill"})
    shard = 4 << 20
    data = write_blocks(src, fp, 12, world=1, shard=shard)
    out = str(tmp_path / "big.pack")
    pack.export_pack(src, fp, out)
    dest = str(tmp_path / "dest")
    env = private_env(storage=dest, HPKV_STORAGE_FSYNC="1")  # slower writes: a kill lands mid-way
    proc = subprocess.Popen([sys.executable, "-m", "hpkv", "import", out], env=env)
    try:
        wait_for(lambda: len(kv_files(dest)) >= 2 or proc.poll() is not None, 60, "the first files")
        proc.kill()
    finally:
        proc.wait()
    files = kv_files(dest)
    assert files and proc.returncode == -9, "killed before it wrote anything, or after it ended"
    for p in files:
        key = bytes.fromhex(p.name.split("-")[0])
        assert verify_file(str(p), fp, key, 0, 1, shard) == data[key][0], f"{p} is not the whole block"
    leftovers = [p for p in Path(dest).rglob(".*.tmp")]
    assert all(kvfile.parse_tmp_name(p.name) is not None for p in leftovers), leftovers


def test_an_import_into_a_namespace_with_unjournaled_files_leaves_its_attach_scan_in_place(
    tmp_path, made_pack
):
    # Files no journal lists (an hpkv before journals, a copy by hand): a first journal would make
    # a server's attach read it and skip the scan that finds them; the import does not write one.
    out, _, fp, data = made_pack
    dest = private_dir(tmp_path / "dest")
    older = write_blocks(dest, fp, 3)  # the pack's first 3 keys, other bytes: kept as they are
    extra = {k: v for k, v in write_blocks(str(tmp_path / "x"), fp, 6).items() if k not in data}
    for k in extra:  # and 2 blocks the pack does not hold
        for r in range(WORLD):
            src = kvfile.file_path(str(tmp_path / "x"), fp, k, r)
            os.makedirs(os.path.dirname(kvfile.file_path(dest, fp, k, r)), mode=0o700, exist_ok=True)
            os.link(src, kvfile.file_path(dest, fp, k, r))
    report = pack.import_pack(out, dest)
    assert report.journal == "" and not os.path.exists(os.path.join(dest, fp, ".journal"))
    assert report.files_present == 6 and report.files_written == 2  # 3 of 4 blocks were there
    with running(private_env(storage=dest, HPKV_STORAGE_LOOKUP_WAIT_MS="5000")) as srv:
        w = Writer(srv, world=WORLD, shard=SHARD, fp=fp)
        keys = list(data) + list(extra)
        wait_for(lambda: w.storage()["files"] == len(keys) * WORLD, 10, "the attach scan")
        assert w.c.lookup(w.ns.ns_id, keys) == (len(keys), [2] * len(keys))
        w.data = {**data, **extra, **older}
        w.check_rows(keys, w.c.promote(w.ns.ns_id, keys))
        w.close()
