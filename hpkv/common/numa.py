"""NUMA placement: which node serves a device, its CPUs, and a memory policy for a worker."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence


def numa_nodes(sysfs: str = "/sys") -> list[int]:
    try:
        return sorted(
            int(n[4:])
            for n in os.listdir(f"{sysfs}/devices/system/node")
            if n.startswith("node") and n[4:].isdigit()
        )
    except OSError:
        return [0]


def node_cpus(node: int, sysfs: str = "/sys") -> list[int]:
    """The CPUs of NUMA node ``node`` ([] if unknown)."""
    try:
        with open(f"{sysfs}/devices/system/node/node{node}/cpulist") as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return []


def parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: Iterable[int]) -> str:
    """``cpus`` as a comma-separated list, in order (for logs and tables)."""
    return ",".join(map(str, sorted(cpus)))


def device_cpus(device: str, numa_node: int | None) -> tuple[int, list[int]]:
    """The NUMA node to serve ``device`` from and the CPUs of that node we may run on.

    The connector tells us the node: the GPU's PCI ``numa_node`` on CUDA, the node
    of the engine worker's CPUs on the CPU backend. Unknown (-1/None) → node 0 or
    all CPUs we are allowed.
    """
    allowed = sorted(os.sched_getaffinity(0))
    node = numa_node if numa_node is not None and numa_node >= 0 else 0
    cpus = [c for c in node_cpus(node) if c in allowed]
    return node, cpus or allowed


def spread_cpus(cpus: Sequence[int], n: int, first: int = 0) -> list[set[int]]:
    """``cpus`` dealt into ``min(n, len(cpus))`` disjoint sets, one per thread that must never
    share a CPU with another of them, starting with set ``first`` (modulo their number): workers
    that start at different sets spread their first threads over the CPUs."""
    n = max(1, min(n, len(cpus)))
    sets = [set(cpus[i::n]) for i in range(n)]
    k = first % n
    return sets[k:] + sets[:k]


def set_memory_node(node: int) -> str:
    """Prefer allocations from ``node`` (MPOL_PREFERRED); returns what happened, for the log."""
    if len(numa_nodes()) <= 1:
        return "single NUMA node: no memory policy needed"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    MPOL_PREFERRED = 1
    SYS_set_mempolicy = 238 if os.uname().machine == "x86_64" else 237
    mask = ctypes.c_ulong(1 << node)
    if libc.syscall(SYS_set_mempolicy, MPOL_PREFERRED, ctypes.byref(mask), 64) != 0:
        return f"set_mempolicy(node {node}) failed: {os.strerror(ctypes.get_errno())}"
    return f"memory bound to node {node} (preferred)"


def current_numa_node() -> int:
    """The NUMA node of the CPUs this process runs on (an engine worker's transfer worker is placed there)."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for entry in os.listdir(f"/sys/devices/system/cpu/cpu{cpus[0]}"):
            if entry.startswith("node") and entry[4:].isdigit():
                return int(entry[4:])
    except (OSError, IndexError):
        pass
    return 0
