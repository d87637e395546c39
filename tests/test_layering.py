"""The import graph keeps the architecture (docs/architecture.md): a folder per process,
imports pointing one way (connectors → client → protocol ← engine → io_workers, runtime),
no two folders importing each other, and worker processes loading only protocol, shared
primitives, the worker runtime and their own code. Deferred imports (inside functions) count
too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpkv"

# room -> rooms it may import (besides itself)
COMMON = {"common"}
ALLOWED = {
    "common": set(),
    "protocol": COMMON,
    "client": COMMON | {"protocol"},
    "connectors": COMMON | {"protocol", "client"},
    "monitor": COMMON | {"protocol"},
    # the worker processes' rooms: none of them imports the server (engine)
    "runtime": COMMON | {"protocol"},
    "transfer_workers": COMMON | {"protocol", "runtime"},
    "io_workers": COMMON | {"protocol", "runtime"},
    # the server: it reads KV files (io_workers: the format) and hosts the exporter
    "engine": COMMON | {"protocol", "runtime", "io_workers", "hpkv.monitor.metrics"},
    "top": None,  # cli, doctor, bench, testing: may import anything
}
WORKER_ROOMS = ("runtime", "transfer_workers", "io_workers")
# The processes a worker runs must not load the server (nor clients, monitors, connectors).
WORKER_MAINS = ("hpkv.transfer_workers.worker", "hpkv.io_workers.worker", "hpkv.io_workers.remote_worker")


def room(module: str) -> str:
    parts = module.split(".")
    if module in ("hpkv", "hpkv.config") or parts[1:2] in (["common"], ["ring"]):
        return "common"
    # doctor: a command (``hpkv doctor``) that asks every layer's own checks, like the CLI
    if parts[1] in ("cli", "__main__", "bench", "testing", "doctor"):
        return "top"
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if "sglang_shims" not in p.parts}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """hpkv modules ``path`` imports anywhere (resolved to the module, or its package)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("hpkv"):
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def test_rooms_import_only_downwards():
    bad = []
    for mod, deps in graph().items():
        src = room(mod)
        allowed = ALLOWED[src]
        if allowed is None:
            continue
        for dep in deps:
            if dep == "hpkv":
                continue
            dst = room(dep)
            if dst == src or dst in allowed or dep in allowed:
                continue
            bad.append(f"{mod} ({src}) imports {dep} ({dst})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_nothing_below_the_top_imports_cli_bench_or_testing():
    bad = [
        f"{m} imports {d}"
        for m, deps in graph().items()
        if room(m) != "top"
        for d in deps
        if room(d) == "top"
    ]
    assert not bad, bad


@pytest.mark.parametrize("main", WORKER_MAINS)
def test_worker_processes_load_no_server_code(main):
    g = graph()
    seen, todo = set(), [main]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(g.get(m, ()))
    loaded = sorted(m for m in seen if room(m) in ("engine", "client", "connectors", "monitor", "top"))
    assert not loaded, f"{main} loads {loaded}"


def test_no_two_rooms_import_each_other():
    arrows = {(room(m), room(d)) for m, deps in graph().items() for d in deps if d != "hpkv"}
    two_way = sorted({tuple(sorted(a)) for a in arrows if a[0] != a[1] and a[::-1] in arrows})
    assert not two_way, f"rooms importing each other: {two_way}"


def test_the_rules_whitelist_no_two_way_pair_and_no_worker_room_imports_the_server():
    pairs = [
        (a, b)
        for a, allowed in ALLOWED.items()
        for b in allowed or ()
        if b in ALLOWED and a in (ALLOWED[b] or ())
    ]
    assert not pairs, pairs
    for worker_room in WORKER_ROOMS:
        assert not any(d == "engine" or d.startswith("hpkv.engine") for d in ALLOWED[worker_room])


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            # a package's __init__ importing its own submodules is how packages export names
            if m == d.rpartition(".")[0] or d == m.rpartition(".")[0] and m.startswith(d + "."):
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself: a client module importing the server is caught."""
    p = tmp_path / "bad.py"
    p.write_text("def f():\n    from hpkv.engine.server import Server\n")
    assert imports_of(p, set(modules())) == {"hpkv.engine.server"}
    assert room("hpkv.engine.server") not in ALLOWED["client"]
