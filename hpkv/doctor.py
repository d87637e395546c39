"""``hpkv doctor``: check a deployment before the engine starts and say what to fix.

Each check is a small function that returns :class:`Finding` s, one line each, with a level:

* ``fail``: hpkv would refuse to start or could lose or leak data (the pool directory is not
  private or not writable, the pool does not fit its file system, the storage path or one of
  its parents is unsafe, a path did not answer);
* ``warn``: hpkv runs, but slower or less safely than it could (a pool on a disk file system,
  a memory-lock limit under the pool size, NFS without the recommended options, no huge pages,
  an engine release hpkv is not tested with, a server already running with its own settings);
* ``ok``: what was found, so the output doubles as a description of the machine.

The checks ask the same functions the server acts on (:mod:`hpkv.config`'s runtime questions,
:func:`hpkv.common.security.check_private`, :meth:`hpkv.io_workers.tree.StorageTree.check`,
:func:`hpkv.engine.storage.probe.probe_o_direct`), so doctor and the server cannot disagree.

Doctor changes nothing: it creates no directory and no pool file; the write and O_DIRECT probes
create one file each and remove it (a missing storage directory is probed in its nearest existing
parent, on the same file system). Every check runs in a thread with a deadline, so a hung mount
becomes a ``fail`` line ("did not answer within N s") instead of a hung command.

Exit status of ``hpkv doctor``: 0 when nothing fails (warnings allowed), 1 when something fails,
2 for a bad command line (argparse's).
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hpkv.common.checks import (
    RAM_FILESYSTEMS,
    Mount,
    existing_ancestor,
    memory_available,
    mount_of,
    pool_disk_warning,
    pool_space_error,
    write_probe_error,
)
from hpkv.common.numa import format_cpulist, node_cpus, numa_nodes
from hpkv.common.security import InsecurePath, check_private
from hpkv.config import Config, ConfigError, format_size, load_config
from hpkv.connectors import ENGINE_DISTRIBUTIONS, TESTED_VERSIONS

OK, WARN, FAIL = "ok", "warn", "fail"
DEFAULT_TIMEOUT_S = 10.0
#: CT-HPKV documents its pool on tmpfs with Linux 5.15 or newer.
MIN_KERNEL = (5, 15)
CAP_IPC_LOCK = 14
POOL_WHAT = "the pool directory (HPKV_SHARE_MEM_FILE_PATH)"
STORAGE_WHAT = "the storage directory (HPKV_KV_STORAGE_PATH)"
#: NFS: a positive-only lookup cache and attribute caching of at most this many seconds let a
#: server see files other nodes write or delete within hpkv's own 2-s re-check.
NFS_MAX_ACDIR_S = 2
NFS_ADVICE = "lookupcache=positive,actimeo=1"


@dataclass(frozen=True)
class Finding:
    check: str  # e.g. "pool.dir"
    level: str  # ok | warn | fail
    message: str  # one line: the value, what it means, what to do
    value: Any = None  # JSON-able: the path, size, version, ... the message is about


Check = Callable[[], list[Finding]]


# --------------------------------------------------------------------------- running
def bounded(check_id: str, what: str, fn: Check, timeout: float) -> tuple[list[Finding], bool]:
    """``fn()`` in a daemon thread, given ``timeout`` seconds; returns its findings and whether
    it answered. A check stuck in the kernel (a hung NFS or FUSE mount) is left behind: the
    thread cannot be stopped, only abandoned, and the caller exits without waiting for it."""
    box: list[list[Finding]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as exc:  # noqa: BLE001 - a check's own bug is reported, not fatal
            errors.append(exc)

    t = threading.Thread(target=run, name=f"doctor-{check_id}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return [
            Finding(
                check_id,
                FAIL,
                f"{what} did not answer within {timeout:g} s: a hung mount (NFS server gone, FUSE "
                "daemon stopped)? hpkv would hang the same way; check `mount` and the file server",
                what,
            )
        ], False
    if errors:
        exc = errors[0]
        return [Finding(check_id, FAIL, f"the check failed: {type(exc).__name__}: {exc}", None)], True
    return box[0], True


def run_checks(
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    sysfs: str = "/sys",
    search_path: list[str] | None = None,
) -> tuple[list[Finding], bool]:
    """Every check, in the order they are printed; also whether all of them answered."""
    findings: list[Finding] = []
    answered = True
    cfg: Config | None = None
    try:
        cfg = load_config(env)
        findings += check_config(cfg)
    except ConfigError as exc:
        findings.append(
            Finding("config", FAIL, f"{exc} (the checks that need the configuration are left out)", None)
        )
    groups: list[tuple[str, str, Check]] = [("kernel", "the kernel", check_kernel)]
    if cfg is not None:
        c = cfg
        groups += [
            ("server", f"the pool directory {c.pool_dir}", lambda: check_server(c)),
            ("pool", f"the pool directory {c.pool_dir}", lambda: check_pool(c)),
            ("memlock", "the memory lock limit", lambda: check_memlock(c)),
            ("hugepages", f"the pool directory {c.pool_dir}", lambda: check_huge_pages(c)),
            ("storage", f"the storage path {c.storage_path}", lambda: check_storage(c)),
        ]
    groups += [
        ("numa", "the NUMA topology", lambda: check_numa(sysfs)),
        ("engines", "the installed engines", lambda: check_engines(search_path)),
    ]
    for check_id, what, fn in groups:
        out, done = bounded(check_id, what, fn, timeout)
        findings += out
        answered = answered and done
    return findings, answered


def exit_status(findings: Iterable[Finding]) -> int:
    return 1 if any(f.level == FAIL for f in findings) else 0


def format_findings(findings: list[Finding]) -> str:
    width = max((len(f.check) for f in findings), default=0)
    lines = [
        f"{f.level.upper() if f.level == FAIL else f.level:4}  {f.check:{width}}  {f.message}"
        for f in findings
    ]
    fails = sum(f.level == FAIL for f in findings)
    warns = sum(f.level == WARN for f in findings)
    verdict = (
        "fix the FAIL lines before starting the engine"
        if fails
        else "nothing blocks hpkv" + (" (the warnings cost speed or safety)" if warns else "")
    )
    lines += ["", f"hpkv doctor: {fails} failure(s), {warns} warning(s): {verdict}"]
    return "\n".join(lines)


def dumps_findings(findings: list[Finding]) -> str:
    return json.dumps([asdict(f) for f in findings], indent=2, default=str)


def main(as_json: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    findings, answered = run_checks(timeout=timeout)
    print(dumps_findings(findings) if as_json else format_findings(findings))
    status = exit_status(findings)
    if not answered:
        # A check is stuck in the kernel: exit without the interpreter's shutdown, which
        # could wait on it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


# --------------------------------------------------------------------------- configuration
def check_config(cfg: Config) -> list[Finding]:
    """The resolved configuration: where it came from, and every value not left at its default."""
    found = "" if cfg.config_file_found else " (not found)"
    changed = [
        f"{name}={s.raw} ({s.source})" for name, s in cfg.settings.items() if s.source.kind != "default"
    ]
    message = f"config file {cfg.config_file}{found}; " + (
        "set: " + ", ".join(changed) + "; the rest default" if changed else "every key at its default"
    )
    out = [Finding("config", OK, message, cfg.as_json())]
    out += [Finding("config", WARN, w, None) for w in cfg.warnings]
    return out


def check_server(cfg: Config) -> list[Finding]:
    from hpkv.monitor.status import server_pid

    pid = server_pid(cfg)
    if pid is None:
        return [
            Finding(
                "server",
                OK,
                f"no hpkv server runs for {cfg.pool_dir}: the first engine starts one with this configuration",
                None,
            )
        ]
    return [
        Finding(
            "server",
            WARN,
            f"hpkv server pid {pid} already serves {cfg.pool_dir}: an engine started now attaches to it "
            "and gets the pool size and storage it was started with, not this configuration's "
            "(`hpkv status` shows them; `hpkv stop` first to apply a change)",
            pid,
        )
    ]


def kernel_release(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_kernel() -> list[Finding]:
    release = platform.release()
    if kernel_release(release) >= MIN_KERNEL:
        return [
            Finding(
                "kernel", OK, f"Linux {release}: the DRAM pool belongs on tmpfs (CT-HPKV: 5.15+)", release
            )
        ]
    return [
        Finding(
            "kernel",
            WARN,
            f"Linux {release} is older than {MIN_KERNEL[0]}.{MIN_KERNEL[1]}, which CT-HPKV documents "
            "with the pool on tmpfs: hpkv runs, but older kernels lack what it uses when present "
            "(MADV_POPULATE_WRITE 5.14, openat2 5.6, tmpfs O_DIRECT 6.6); upgrade, or keep the pool on ramfs",
            release,
        )
    ]


# --------------------------------------------------------------------------- the DRAM pool
def _creatable(path: str) -> str | None:
    """Why a missing ``path`` cannot be made by this user, or None."""
    parent = existing_ancestor(path)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable by uid {os.geteuid()}"
    return None


def pool_dir_finding(cfg: Config) -> Finding:
    """The pool directory: private to us (or creatable, then 0700) and writable."""
    path = cfg.pool_dir
    if not os.path.lexists(path):
        why = _creatable(path)
        if why:
            return Finding(
                "pool.dir", FAIL, f"{path} does not exist and cannot be created: {why}; create it 0700", path
            )
        return Finding("pool.dir", OK, f"{path} does not exist yet: the server creates it 0700", path)
    try:
        check_private(os.lstat(path), path, POOL_WHAT)
    except InsecurePath as exc:
        return Finding("pool.dir", FAIL, f"{exc.strerror}; the server refuses it", path)
    problem = write_probe_error("HPKV_SHARE_MEM_FILE_PATH", path, cfg.source("HPKV_SHARE_MEM_FILE_PATH"))
    if problem:
        return Finding("pool.dir", FAIL, problem, path)
    return Finding("pool.dir", OK, f"{path} exists, is private to uid {os.geteuid()} and writable", path)


def check_pool(cfg: Config) -> list[Finding]:
    """The pool directory's file system, privacy and writability, and the pool's size against it."""
    out: list[Finding] = []
    path = cfg.pool_dir
    mount = mount_of(path)
    disk = pool_disk_warning(cfg)
    if disk:
        out.append(Finding("pool.fs", WARN, disk, mount.fstype))
    else:
        out.append(Finding("pool.fs", OK, f"{path} is on {mount.fstype} ({mount.mountpoint})", mount.fstype))

    out.append(pool_dir_finding(cfg))
    if not os.path.isdir(existing_ancestor(path)):
        return out  # a file where a parent should be: pool.dir says so, the rest cannot be asked

    space = pool_space_error(cfg)
    if space:
        out.append(Finding("pool.space", FAIL, space, cfg.pool_size))
        return out
    out.append(
        Finding(
            "pool.space",
            OK,
            f"HPKV_KV_MEM_POOL_SIZE {format_size(cfg.pool_size)} fits the free space of {mount.mountpoint}",
            cfg.pool_size,
        )
    )
    pool_file = os.path.join(path, "pool")
    allocated = os.stat(pool_file).st_blocks * 512 if os.path.isfile(pool_file) else 0
    available = memory_available()
    if available and cfg.pool_size - allocated > available:
        out.append(
            Finding(
                "pool.memory",
                WARN,
                f"HPKV_KV_MEM_POOL_SIZE {format_size(cfg.pool_size)} is more than the memory available "
                f"now ({format_size(available)}): a filled pool pushes other memory (the engine's) into "
                "swap or wakes the OOM killer; lower it",
                available,
            )
        )
    return out


def has_capability(cap: int) -> bool:
    """Whether this process holds capability ``cap`` (its effective set, /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_finding(pool_size: int, soft_limit: int, can_lock: bool) -> Finding:
    """The memory-lock verdict for a pool of ``pool_size`` under ``ulimit -l`` = ``soft_limit``."""
    if can_lock:
        return Finding(
            "memlock", OK, "CAP_IPC_LOCK: the pool is locked in memory whatever `ulimit -l` says", None
        )
    if soft_limit == resource.RLIM_INFINITY or soft_limit >= pool_size:
        shown = "unlimited" if soft_limit == resource.RLIM_INFINITY else format_size(soft_limit)
        return Finding("memlock", OK, f"ulimit -l is {shown}: the pool can be locked in memory", soft_limit)
    return Finding(
        "memlock",
        WARN,
        f"ulimit -l is {format_size(soft_limit)}, under the {format_size(pool_size)} pool: the server "
        "locks what it can, logs 'not locked in memory' and runs on, and the kernel may swap pool pages "
        "out (a DRAM hit then waits for the disk). Raise the limit of the process that starts the server "
        "(`ulimit -l unlimited`, memlock in /etc/security/limits.conf, LimitMEMLOCK=infinity in systemd, "
        "`docker run --ulimit memlock=-1`) or grant CAP_IPC_LOCK",
        soft_limit,
    )


def check_memlock(cfg: Config) -> list[Finding]:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return [memlock_finding(cfg.pool_size, soft, has_capability(CAP_IPC_LOCK))]


def shmem_huge_setting(sysfs: str = "/sys") -> str:
    """The bracketed choice of transparent_hugepage/shmem_enabled ('' if unknown)."""
    try:
        with open(f"{sysfs}/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            m = re.search(r"\[(\w[\w-]*)\]", f.read())
            return m.group(1) if m else ""
    except OSError:
        return ""


def huge_pages_finding(mount: Mount, shmem_enabled: str) -> Finding:
    """Whether the pool file gets huge pages: tmpfs mounted ``huge=always`` or ``within_size``
    (hpkv does not madvise, so ``advise`` does not count), or shmem_enabled ``force``."""
    opts = dict(o.partition("=")[::2] for o in mount.options)
    huge = opts.get("huge", "never")
    if (
        mount.fstype == "tmpfs"
        and shmem_enabled != "deny"
        and (huge in ("always", "within_size") or shmem_enabled == "force")
    ):
        return Finding(
            "hugepages",
            OK,
            f"the pool gets huge pages ({mount.mountpoint}: huge={huge}, shmem_enabled {shmem_enabled})",
            huge,
        )
    fix = (
        f"`mount -o remount,huge=within_size {mount.mountpoint}`"
        if mount.fstype == "tmpfs"
        else "a tmpfs mounted with huge=within_size"
    )
    return Finding(
        "hugepages",
        WARN,
        f"the pool gets 4 KiB pages ({mount.fstype} {mount.mountpoint}: huge={huge}, shmem_enabled "
        f"{shmem_enabled or 'unknown'}): filling and mapping it costs one page fault per 4 KiB; {fix} "
        "gives it 2 MiB pages",
        huge,
    )


def check_huge_pages(cfg: Config) -> list[Finding]:
    return [huge_pages_finding(mount_of(cfg.pool_dir), shmem_huge_setting())]


# --------------------------------------------------------------------------- the storage tier
def nfs_finding(mount: Mount) -> Finding | None:
    """For an NFS storage mount, whether its caching lets this server see other nodes' files
    in time (None for other file systems)."""
    if not mount.fstype.startswith("nfs"):
        return None
    opts = dict(o.partition("=")[::2] for o in mount.options)
    lookup_ok = opts.get("lookupcache") in ("pos", "positive", "none")
    try:
        acdir = int(opts.get("acdirmax", "60"))  # the kernel lists it only when not the default (60)
    except ValueError:
        acdir = 60
    if lookup_ok and acdir <= NFS_MAX_ACDIR_S:
        return Finding(
            "storage.nfs",
            OK,
            f"NFS mount {mount.mountpoint} has {NFS_ADVICE}-like caching",
            list(mount.options),
        )
    return Finding(
        "storage.nfs",
        WARN,
        f"NFS mount {mount.mountpoint} (lookupcache={opts.get('lookupcache', 'all')}, acdirmax={acdir}): "
        "KV files other nodes write stay invisible, and deleted ones keep being reported as hits, "
        f"for up to the cache time; mount it with {NFS_ADVICE}",
        list(mount.options),
    )


def check_storage(cfg: Config) -> list[Finding]:
    """The storage path: safe to trust, writable, O_DIRECT at write and read, free space, file system."""
    from hpkv.engine.storage.probe import probe_o_direct
    from hpkv.io_workers.tree import StorageTree

    path = cfg.storage_path
    if path is None:
        return [
            Finding(
                "storage", OK, "storage tier disabled (HPKV_KV_STORAGE_PATH is empty): DRAM pool only", None
            )
        ]
    out: list[Finding] = []
    try:
        exists = StorageTree.check(path, STORAGE_WHAT)
    except InsecurePath as exc:
        return [Finding("storage.dir", FAIL, f"{exc.strerror}; the server refuses it", path)]
    src = cfg.source("HPKV_KV_STORAGE_PATH")
    if exists:
        problem = write_probe_error("HPKV_KV_STORAGE_PATH", path, src)
        if problem:
            return [Finding("storage.dir", FAIL, problem, path)]
        out.append(
            Finding(
                "storage.dir", OK, f"{path} is private to uid {os.geteuid()}, writable, parents safe", path
            )
        )
        probe_dir = path
    else:
        why = _creatable(path)
        if why:
            return [
                Finding(
                    "storage.dir",
                    FAIL,
                    f"{path} does not exist and cannot be created: {why}; create it 0700",
                    path,
                )
            ]
        probe_dir = existing_ancestor(path)
        out.append(
            Finding(
                "storage.dir",
                OK,
                f"{path} does not exist yet: the server creates it 0700; parents safe",
                path,
            )
        )

    probe = probe_o_direct(probe_dir)
    where = "" if probe_dir == path else f" (probed in {probe_dir}: same file system)"
    if probe.ok:
        out.append(
            Finding("storage.o_direct", OK, f"O_DIRECT write and read work on {probe.fs_type}{where}", True)
        )
    else:
        out.append(
            Finding(
                "storage.o_direct",
                WARN,
                f"O_DIRECT is refused on {path}{where}: {probe.reason}; the IO workers fall back to buffered "
                "IO (KV files go through the page cache and compete with the pool for memory); put "
                "HPKV_KV_STORAGE_PATH on a local ext4/xfs file system",
                False,
            )
        )

    mount = mount_of(path)
    if mount.fstype in RAM_FILESYSTEMS:
        out.append(
            Finding(
                "storage.fs",
                WARN,
                f"{path} is on {mount.fstype}: KV files take RAM beside the pool and are lost at reboot; "
                "use a disk (NVMe) or a parallel file system",
                mount.fstype,
            )
        )
    else:
        out.append(
            Finding("storage.fs", OK, f"{path} is on {mount.fstype} ({mount.mountpoint})", mount.fstype)
        )
    nfs = nfs_finding(mount)
    if nfs:
        out.append(nfs)
    out.append(storage_space_finding(cfg, probe_dir))
    return out


def storage_space_finding(cfg: Config, directory: str) -> Finding:
    st = os.statvfs(directory)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    min_free = float(cfg["HPKV_STORAGE_MIN_FREE"])
    capacity = int(cfg["HPKV_KV_STORAGE_SIZE"])
    if total and free * 100.0 / total < min_free:
        return Finding(
            "storage.space",
            WARN,
            f"{format_size(free)} free of {format_size(total)} ({free * 100.0 / total:.1f}%), under "
            f"HPKV_STORAGE_MIN_FREE={min_free:g}%: spilling to storage stays paused until space is freed",
            free,
        )
    if capacity and total and capacity > total:
        return Finding(
            "storage.space",
            WARN,
            f"HPKV_KV_STORAGE_SIZE {format_size(capacity)} is more than the whole file system "
            f"({format_size(total)}): spilling pauses at {min_free:g}% free before the capacity evicts anything",
            free,
        )
    limit = f"capacity {format_size(capacity)}" if capacity else "no capacity limit (HPKV_KV_STORAGE_SIZE=0)"
    return Finding(
        "storage.space",
        OK,
        f"{format_size(free)} free of {format_size(total)}; {limit}; spilling pauses under {min_free:g}% free",
        free,
    )


# --------------------------------------------------------------------------- NUMA and devices
def nvidia_gpus(sysfs: str = "/sys") -> dict[str, int]:
    """NVIDIA PCI display/3D devices -> their NUMA node (-1: the firmware names none)."""
    gpus: dict[str, int] = {}
    base = f"{sysfs}/bus/pci/devices"
    try:
        addrs = sorted(os.listdir(base))
    except OSError:
        return gpus
    for addr in addrs:
        try:
            with open(f"{base}/{addr}/vendor") as f:
                vendor = f.read().strip()
            with open(f"{base}/{addr}/class") as f:
                cls = f.read().strip()
            if vendor != "0x10de" or not cls.startswith("0x03"):
                continue
            try:
                with open(f"{base}/{addr}/numa_node") as f:
                    gpus[addr] = int(f.read().strip())
            except (OSError, ValueError):
                gpus[addr] = -1
        except OSError:
            continue
    return gpus


def check_numa(sysfs: str = "/sys") -> list[Finding]:
    """NUMA nodes against devices: each GPU's transfer worker runs on its node's CPUs."""
    nodes = numa_nodes(sysfs)
    gpus = nvidia_gpus(sysfs)
    allowed = set(os.sched_getaffinity(0))
    cpus = {n: node_cpus(n, sysfs) for n in nodes}
    value = {"nodes": cpus, "gpus": gpus}
    layout = "; ".join(f"{n}: cpus {format_cpulist(c)}" for n, c in cpus.items())
    head = f"{len(nodes)} NUMA node(s) ({layout})"
    if not gpus:
        return [
            Finding(
                "numa", OK, f"{head}; no NVIDIA GPU: transfer workers run on the engine workers' nodes", value
            )
        ]
    out = []
    for addr, node in gpus.items():
        if node < 0 and len(nodes) > 1:
            out.append(
                Finding(
                    "numa",
                    WARN,
                    f"GPU {addr} names no NUMA node (-1): its transfer worker runs on node 0's CPUs, maybe "
                    "across the socket link; enable NUMA reporting in the firmware (ACPI SRAT/_PXM) or the VM",
                    value,
                )
            )
        elif node >= 0 and not set(node_cpus(node, sysfs)) & allowed:
            out.append(
                Finding(
                    "numa",
                    WARN,
                    f"GPU {addr} is on node {node}, but none of that node's CPUs is allowed here (cpus "
                    f"{format_cpulist(allowed)}): its transfer worker falls back to the allowed CPUs; widen "
                    "the cpuset/taskset of the engine",
                    value,
                )
            )
    if not out:
        where = ", ".join(f"{a} on node {max(n, 0)}" for a, n in gpus.items())
        out.append(Finding("numa", OK, f"{head}; {len(gpus)} GPU(s): {where}", value))
    return out


# --------------------------------------------------------------------------- engines
def installed_version(names: Iterable[str], search_path: list[str] | None = None) -> tuple[str, str] | None:
    """(distribution name, version) of the first of ``names`` installed, or None."""
    import importlib.metadata

    for name in names:
        for dist in importlib.metadata.distributions(name=name, path=search_path or sys.path):
            return str(dist.metadata["Name"]), str(dist.version)
    return None


def engine_finding(engine: str, installed: tuple[str, str] | None) -> Finding:
    tested = TESTED_VERSIONS[engine]
    check = f"engine.{engine}"
    if installed is None:
        return Finding(check, OK, f"{engine} is not installed for {sys.executable}", None)
    dist, version = installed
    if version.split("+")[0] == tested:
        return Finding(check, OK, f"{dist} {version}: the release hpkv is tested with", version)
    return Finding(
        check,
        WARN,
        f"{dist} {version} is installed, hpkv is tested with {tested}: the connector API may differ "
        f"(a failure at start, or silent recomputes); install {dist}=={tested}",
        version,
    )


def check_engines(search_path: list[str] | None = None) -> list[Finding]:
    found = {e: installed_version(names, search_path) for e, names in ENGINE_DISTRIBUTIONS.items()}
    out = [engine_finding(e, v) for e, v in found.items()]
    if not any(found.values()):
        out.append(
            Finding(
                "engines",
                WARN,
                f"neither vLLM nor SGLang is installed for {sys.executable}: run `hpkv doctor` with the "
                "Python the engine runs (its virtual environment)",
                None,
            )
        )
    return out
