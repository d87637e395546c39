"""A real vLLM server serves the tiny model, and VllmServer cleans up after it.

The ``vllm``-marked test starts the real server (≈ 2 minutes on 2 cores) with
CT-HPKV's connector configured and ``VLLM_ENABLE_HPKV=0``: vLLM serves as without
hpkv, the connector says once that it does nothing, and no hpkv server starts. The
other tests drive VllmServer against a fake ``vllm.entrypoints.openai.api_server``
module (shadowing the real one through PYTHONPATH) that starts in a second, so
the stop/kill/reap logic is tested cheaply, including children that ignore
SIGTERM and grandchildren orphaned by a server that exits first.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from hpkv.testing.server import private_env
from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, VllmServerError


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


@pytest.fixture
def hpkv_disabled_env() -> Iterator[dict[str, str]]:
    env = private_env(storage="", VLLM_ENABLE_HPKV="0")
    try:
        yield env
    finally:
        shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        os.unlink(env["HPKV_CONFIG_FILE_PATH"])


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_with_hpkv_disabled_serves_the_tiny_model_and_stops_cleanly(
    vllm_server: Callable[..., VllmServer], hpkv_disabled_env: dict[str, str]
) -> None:
    env = hpkv_disabled_env
    t0 = time.monotonic()
    srv = vllm_server(extra_args=["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG], env=env)
    print(f"vLLM ready after {time.monotonic() - t0:.1f} s at {srv.url}")
    assert "VLLM_ENABLE_HPKV=0 (from environment): the connector does nothing" in srv.log_tail(100_000)

    tree = srv.process_tree()
    names = [p.name() for p in tree]
    assert len(tree) >= 2, f"expected the API server plus EngineCore/worker processes, got {names}"
    ipc_dir = Path(psutil.Process(srv.pid).environ()["VLLM_RPC_BASE_PATH"])
    assert any(ipc_dir.iterdir()), "vLLM's ZMQ sockets are in the server's own directory"

    # Temperature 0 and ignore_eos: random weights may pick EOS at once.
    resp = srv.completion("A B C D", max_tokens=4, temperature=0, ignore_eos=True)
    choice = resp["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["finish_reason"] == "length"
    # One token per letter, no BOS added by the tokenizer.
    assert resp["usage"] == {**resp["usage"], "prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}

    long = srv.completion(" ".join(["A"] * 1000), max_tokens=1, ignore_eos=True)
    assert long["usage"]["prompt_tokens"] == 1000
    prompt = " ".join("ABCDEFGH"[i % 7] for i in range(300))
    first = srv.completion(prompt, max_tokens=4, temperature=0, ignore_eos=True)
    again = srv.completion(prompt, max_tokens=4, temperature=0, ignore_eos=True)  # vLLM's prefix cache
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    status = subprocess.run(
        [sys.executable, "-m", "hpkv", "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 1, f"no hpkv server was started: {status.stdout}"

    models = srv.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [srv.model_name]

    rc = srv.stop()
    assert rc is not None
    assert not srv.is_running()
    assert srv.leftover_processes() == []
    # psutil.Process remembers each start time, so a reused pid does not count.
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in tree)
    assert not _port_open(srv.host, srv.port)
    assert not ipc_dir.exists()


# --------------------------------------------------------------------- fake server

_FAKE_SERVER = """
import argparse, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host"); ap.add_argument("--port", type=int)
ap.add_argument("--mode", default="ok")
args, _ = ap.parse_known_args()
if args.mode == "crash":
    print("fake server: bad configuration, exiting", flush=True)
    sys.exit(3)
if args.mode == "leaky":  # what a vLLM killed in its shutdown leaves behind
    import socket, tempfile, uuid
    ipc = socket.socket(socket.AF_UNIX)
    ipc.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4())))
    store = os.path.join(tempfile.gettempdir(), "vllm_dist_" + uuid.uuid4().hex)
    open(store, "w").close()
    print(f"world_size=1 rank=0 distributed_init_method=file://{store} backend=gloo", flush=True)
    import mmap
    queue = "/dev/shm/psm_" + uuid.uuid4().hex[:8]  # shm_broadcast's queue, mapped while it runs
    fd = os.open(queue, os.O_CREAT | os.O_RDWR)
    os.ftruncate(fd, 4096)
    mapped = mmap.mmap(fd, 4096)
    print(f"fake server: queue {queue}", flush=True)

# A child that ignores SIGTERM, and a grandchild that will be orphaned.
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
if args.mode != "childless":
    subprocess.Popen([sys.executable, "-c", stubborn])
    subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "time.sleep(600)"])

def on_term(*_):
    print("fake server: SIGTERM, leaving my children behind", flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

print("fake server: listening", flush=True)
HTTPServer((args.host, args.port), H).serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    """Environment that makes ``python -m vllm.entrypoints.openai.api_server`` the fake."""
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(textwrap.dedent(_FAKE_SERVER))
    return {"PYTHONPATH": str(tmp_path / "fake")}


@pytest.mark.timeout(120)
def test_stop_kills_stubborn_and_orphaned_children(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    srv = VllmServer("unused-model", env=fake_vllm, log_path=tmp_path / "fake.log")
    with srv:
        deadline = time.monotonic() + 30
        while len(srv.process_tree()) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = srv.process_tree()
        assert len(tree) >= 4, srv.log_tail()
        t = time.monotonic()
        rc = srv.stop(timeout=4)
        took = time.monotonic() - t
    assert rc == 0
    assert took < 4 + 15
    assert srv.leftover_processes() == []
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in tree)
    assert "SIGTERM, leaving my children behind" in srv.log_tail()
    assert srv.stop() == 0  # idempotent


@pytest.mark.timeout(120)
def test_stop_removes_the_sockets_store_and_segments_a_killed_engine_leaves(
    fake_vllm: dict[str, str], tmp_path: Path
) -> None:
    unrelated = Path(tempfile.gettempdir()) / "vllm_dist_0123456789abcdef"  # not this server's
    unrelated.touch()
    srv = VllmServer(
        "unused-model", extra_args=["--mode", "leaky"], env=fake_vllm, log_path=tmp_path / "l.log"
    )
    try:
        srv.start().wait_ready(30)
        ipc_dir = Path(psutil.Process(srv.pid).environ()["VLLM_RPC_BASE_PATH"])
        assert ipc_dir.parent == Path(tempfile.gettempdir()) and len(list(ipc_dir.iterdir())) == 1
        store = srv.log_tail().split("distributed_init_method=file://")[1].split()[0]
        assert os.path.exists(store)
        queue = srv.log_tail().split("fake server: queue ")[1].split()[0]
        assert os.path.exists(queue)
    finally:
        srv.stop(timeout=4)
        unrelated_kept = unrelated.exists()
        unrelated.unlink()
    assert not ipc_dir.exists() and not os.path.exists(store)
    assert not os.path.exists(queue)
    assert unrelated_kept


@pytest.mark.timeout(120)
def test_wait_ready_fails_early_with_log_tail(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    srv = VllmServer(
        "unused-model", extra_args=["--mode", "crash"], env=fake_vllm, log_path=tmp_path / "crash.log"
    )
    srv.start()
    t = time.monotonic()
    with pytest.raises(VllmServerError, match=r"(?s)exited with code 3.*bad configuration"):
        srv.wait_ready(timeout=60)
    assert time.monotonic() - t < 30
    assert srv.stop() == 3


@pytest.mark.timeout(120)
def test_restart_reuses_port(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    srv = VllmServer("unused-model", env=fake_vllm, log_path=tmp_path / "restart.log")
    try:
        srv.start().wait_ready(30)
        port, pid = srv.port, srv.pid
        srv.restart(30, stop_timeout=4)
        assert srv.port == port and srv.pid != pid
        assert srv.get("/health").status_code == 200
    finally:
        srv.stop(timeout=4)
    assert srv.leftover_processes() == []


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_server_binds_it_is_traded_for_another(
    fake_vllm: dict[str, str], tmp_path: Path
) -> None:
    """free_port's port is free when picked, not when the server binds it: a server that lost it
    starts again on another; one whose port the caller gave fails (never a silent move)."""
    childless = ["--mode", "childless"]
    srv = VllmServer("unused-model", extra_args=childless, env=fake_vllm, log_path=tmp_path / "taken.log")
    with socket.socket() as squatter:  # another process binds the port first
        squatter.bind((srv.host, srv.port))
        squatter.listen(1)
        taken = srv.port
        try:
            srv.start().wait_ready(30)
            assert srv.port != taken and srv.get("/health").status_code == 200
            assert srv.log_path.read_text().count("=== start:") == 2
        finally:
            srv.stop(timeout=4)
        given = VllmServer(
            "unused-model", extra_args=childless, env=fake_vllm, port=taken, log_path=tmp_path / "given.log"
        )
        try:
            with pytest.raises(VllmServerError, match="Address already in use"):
                given.start().wait_ready(30)
            assert given.port == taken
        finally:
            given.stop(timeout=4)
    assert srv.leftover_processes() == given.leftover_processes() == []
