"""Mooncake Store (the optional remote tier's store) inside private network namespaces.

Mooncake binds wildcard addresses whatever it is told, so everything here runs inside
namespaces the test makes (:mod:`hpkv.testing.netns`) and is stopped by pid at the end. The
tests skip, saying why, where there is no root, no ``ip`` or no Mooncake (``pip install
'hpkv[mooncake]'`` plus ``apt-get install libibverbs1``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpkv.io_workers import mooncake_api
from hpkv.testing import mooncake as mc
from hpkv.testing import netns


def _require() -> None:
    why = netns.unavailable() or mooncake_api.unavailable()
    if why:
        pytest.skip(why)


def _client(ns: netns.Netns, m: mc.Master, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hpkv.testing.mooncake",
        "--local",
        ns.addr,
        "--metadata",
        m.metadata,
        "--master",
        m.rpc,
        *args,
    ]


_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], 7777)); print("listening", flush=True)
c, _ = s.accept(); c.sendall(b"hello\\n"); c.close()"""
_CONNECT = """import socket, sys
print(socket.create_connection((sys.argv[1], 7777), timeout=10).makefile().readline(), end="")"""


def test_namespace_has_only_loopback_and_is_deleted_at_the_end() -> None:
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    with netns.namespaces(2, veth=True) as (a, b):
        links = a.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "hv0"]
        # b listens on its veth address; a reaches it over the pair.
        server = b.popen([sys.executable, "-c", _ECHO, b.addr], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        client = a.run([sys.executable, "-c", _CONNECT, b.addr], capture_output=True, text=True, timeout=30)
        assert client.stdout == "hello\n", client.stderr
        sleeper = a.popen(["sleep", "600"])
        names = (a.name, b.name)
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names)


def test_the_store_api_probe_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # an import of it now fails
    with pytest.raises(mooncake_api.MooncakeUnavailable, match=r"hpkv\[mooncake\].*libibverbs1"):
        mooncake_api.store_class()


def test_put_get_exists_through_a_master_in_a_namespace(tmp_path: Path) -> None:
    _require()
    with netns.namespaces(1) as (a,), mc.master(a, tmp_path) as m:
        r = a.run(_client(a, m), capture_output=True, text=True, env=mc.client_env(a.addr), timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        assert out["put"] == [0, 0, 0]
        assert out["exists"] == [1, 1, 1, 0]
        assert out["get"] == [1 << 20] * 3
        assert out["crc"] == out["crc_put"]


def test_objects_held_in_one_namespace_are_read_from_another_over_a_veth(tmp_path: Path) -> None:
    _require()
    with netns.namespaces(2, veth=True) as (a, b), mc.master(a, tmp_path) as m:
        holder = a.popen(
            _client(a, m, "--hold", "--prefix", "shared"),
            env=mc.client_env(a.addr),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert holder.stdout is not None and holder.stdin is not None
        held = json.loads(holder.stdout.readline())
        assert held["put"] == [0, 0, 0]
        r = b.run(
            _client(b, m, "--no-put", "--segment", "0", "--prefix", "shared"),
            capture_output=True,
            text=True,
            env=mc.client_env(b.addr),
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        assert out["exists"] == [1, 1, 1, 0]
        assert out["get"] == [1 << 20] * 3
        assert out["crc"] == held["crc_put"]
        holder.stdin.close()
        assert holder.wait(30) == 0


def test_bench_remote_reports_floors_for_every_object_size_and_leaves_no_namespace() -> None:
    _require()
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    r = subprocess.run(
        [sys.executable, "-m", "hpkv", "bench", "remote", "--json", "--mib", "16", "--repeat", "1", "--samples", "5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [s["object_mib"] for s in out["sizes"]] == [1, 2, 4, 8]
    for s in out["sizes"]:
        assert s["objects"] == 16 // s["object_mib"]
        assert s["put_gbps"] > 0 and s["get_gbps"] > 0
        assert 0 < s["get_p50_ms"] <= s["get_p99_ms"]
        assert set(s["cpu_s_per_gb"]) == {"put_client", "put_holder", "get_client", "get_holder"}
    assert 0 < out["exists_64_present_us"]["p50"] <= out["exists_64_present_us"]["p99"]
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before
