"""CT-HPKV's quick start as a new user runs it: real vLLM, nothing configured, vLLM's own Ctrl-C.

No config file, a pristine ``HOME`` (so the storage tier is the default
``~/.cache/hpkv/storage`` inside it), no HPKV_* variable but the pool directory
(isolation from other tests), the default 8 GiB pool, the default token threshold
and block size, CT-HPKV's command line without a module path, and CT-HPKV's
prompts (``"<L> "`` repeated, trailing space included). vLLM is stopped the way a
user stops it: Ctrl-C in its terminal (SIGINT to its process group), which makes
vLLM SIGKILL every descendant of its engine; the auto-spawned hpkv server must
survive that. hpkv's own counters (``hpkv status --json``) prove which tier served. The
restarted vLLM serves a copy of the model at another path, with new mtimes: its storage hits
show that the namespace names the model by its content.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import requests

from hpkv.testing.server import env_without_hpkv
from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, hpkv_loads, hpkv_status

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

PROMPT_TOKENS = 1400  # > the default threshold (1204 tokens) after whole blocks


def seed_prompt(letter: str) -> str:
    """CT-HPKV's script: ``printf "${letter} %.0s" $(seq 1 N)``."""
    return f"{letter} " * PROMPT_TOKENS


@pytest.fixture
def user_env():
    """A new user's environment: pristine HOME, no hpkv settings but an isolated pool directory."""
    home = tempfile.mkdtemp(prefix="hpkv-home-")
    env = env_without_hpkv()
    env.update(HOME=home, HPKV_SHARE_MEM_FILE_PATH=f"/dev/shm/hpkv-user-{uuid.uuid4().hex[:10]}")
    try:
        yield env
    finally:
        hpkv(env, "stop")
        _kill_server_of(env)
        shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _kill_server_of(env: dict[str, str]) -> None:
    """A server that did not stop when asked (the test failed) is killed, workers included."""
    try:
        with open(os.path.join(env["HPKV_SHARE_MEM_FILE_PATH"], "server.lock")) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if pid > 0:
        import psutil

        try:
            proc = psutil.Process(pid)
            for p in [*proc.children(recursive=True), proc]:
                p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def hpkv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpkv", *args], env=env, capture_output=True, text=True, timeout=180
    )


def start_vllm(model: str, env: dict[str, str], log_path, *extra: str) -> VllmServer:
    srv = VllmServer(
        model,
        extra_args=["--kv-transfer-config", SEED_KV_TRANSFER_CONFIG, *extra],
        env=env,
        dev_mode=True,
        max_model_len=4096,
        log_path=log_path,
    )
    srv.start().wait_ready(timeout=600)
    return srv


def ask(srv: VllmServer, letter: str) -> tuple[str, int]:
    out = srv.completion(seed_prompt(letter), max_tokens=8, temperature=0)
    return out["choices"][0]["text"], out["usage"]["prompt_tokens"]


def hit_tokens(env: dict[str, str], prompt_tokens: int) -> int:
    """What hpkv can serve of a prompt: its whole blocks, less the last token's block."""
    block = max(ns["block_tokens"] for ns in hpkv_status(env)["namespaces"])
    return (prompt_tokens - 1) // block * block


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def reset_prefix_cache(srv: VllmServer) -> None:
    r = requests.post(f"{srv.url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200, r.text


def server_log(env: dict[str, str]) -> str:
    with open(os.path.join(env["HPKV_SHARE_MEM_FILE_PATH"], "server.log")) as f:
        return f.read()


def assert_quiet_logs(srv: VllmServer, env: dict[str, str]) -> None:
    vllm_log = srv.log_tail(100_000)
    assert "cannot reach the hpkv server" not in vllm_log
    assert "lost the hpkv server" not in vllm_log
    text = server_log(env)
    assert "Traceback" not in text, text[-4000:]


def test_quick_start_default_config_ctrl_c_stop_and_restart_from_a_copy_of_the_model(
    tiny_model, user_env, tmp_path
):
    env = user_env
    letters = "AB"
    srv = start_vllm(tiny_model, env, tmp_path / "vllm.log")
    try:
        cold = {L: ask(srv, L) for L in letters}  # prefill; hpkv saves
        hits = {L: hit_tokens(env, cold[L][1]) for L in letters}
        assert all(h >= 1204 for h in hits.values()), hits
        assert {L: ask(srv, L)[0] for L in letters} == {L: cold[L][0] for L in letters}  # GPU hit

        reset_prefix_cache(srv)  # vLLM's cache only
        before = hpkv_loads(env)
        assert {L: ask(srv, L)[0] for L in letters} == {L: cold[L][0] for L in letters}
        assert delta(before, hpkv_loads(env)) == {"dram": sum(hits.values()), "storage": 0}

        status = hpkv_status(env)
        server_pid = status["server"]["pid"]
        # vLLM's EngineCore and its worker each started the server early and hold it while they run
        assert {h["name"] for h in status["holds"]} == {"vllm early start"}, status["holds"]
        assert status["server"]["storage"] == os.path.join(env["HOME"], ".cache/hpkv/storage")
        assert status["pool"]["capacity_bytes"] == 8 << 30  # the default pool

        assert srv.interrupt() is not None, "vLLM did not exit after Ctrl-C"  # vLLM's own shutdown
        status = hpkv_status(env)
        assert status is not None and status["server"]["pid"] == server_pid, (
            "the hpkv server must outlive the engine that started it"
        )
        assert_quiet_logs(srv, env)
        assert "(vllm early start) holds the server: no idle exit while it runs" in server_log(env), (
            "vLLM's early start holds the server: no idle exit while vLLM compiles"
        )
        deadline = time.monotonic() + 10
        while "(vllm early start) released its hold" not in server_log(env):
            assert time.monotonic() < deadline, (
                "vLLM's exit did not end its hold:\n" + server_log(env)[-3000:]
            )
            time.sleep(0.1)

        stop = hpkv(env, "stop")  # writes pending spills first
        assert stop.returncode == 0, stop.stderr
        assert f"server {server_pid} stopped" in stop.stdout and "NOT written" not in stop.stdout, stop.stdout
        assert os.listdir(env["HPKV_SHARE_MEM_FILE_PATH"]) == ["server.log"]

        # A new hpkv, the same storage, and the model copied elsewhere (new path, new mtimes), as
        # another node of a fleet keeps it: the namespace names the model by its content.
        moved = tmp_path / "elsewhere" / os.path.basename(tiny_model)
        shutil.copytree(tiny_model, moved, copy_function=shutil.copy)
        srv = start_vllm(str(moved), env, tmp_path / "vllm-restarted.log")
        before = hpkv_loads(env)
        assert {L: ask(srv, L)[0] for L in letters} == {L: cold[L][0] for L in letters}
        assert delta(before, hpkv_loads(env)) == {"dram": 0, "storage": sum(hits.values())}, (
            "every prompt of the last phase is served from storage, written from the model's first path"
        )
        assert hpkv_status(env)["server"]["pid"] != server_pid
        assert_quiet_logs(srv, env)
    finally:
        srv.stop()


def test_quick_start_tensor_parallel_2_survives_ctrl_c_and_serves_the_restarted_engine(
    tiny_model, user_env, tmp_path
):
    env = {**user_env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    tp = ("--tensor-parallel-size", "2")
    srv = start_vllm(tiny_model, env, tmp_path / "vllm.log", *tp)
    try:
        cold_text, tokens = ask(srv, "C")
        hit = hit_tokens(env, tokens)
        reset_prefix_cache(srv)
        before = hpkv_loads(env)
        assert ask(srv, "C")[0] == cold_text
        assert delta(before, hpkv_loads(env)) == {"dram": hit, "storage": 0}
        server_pid = hpkv_status(env)["server"]["pid"]

        assert srv.interrupt() is not None, "vLLM did not exit after Ctrl-C"
        srv = start_vllm(tiny_model, env, tmp_path / "vllm-restarted.log", *tp)
        status = hpkv_status(env)
        assert status["server"]["pid"] == server_pid, "the same hpkv server serves the restarted engine"
        before = hpkv_loads(env)
        assert ask(srv, "C")[0] == cold_text
        assert delta(before, hpkv_loads(env)) == {"dram": hit, "storage": 0}, (
            "the blocks saved before Ctrl-C are still in hpkv's DRAM pool"
        )
        assert_quiet_logs(srv, env)
        assert srv.interrupt() is not None

        deadline = time.monotonic() + 60  # both ranks' engines detach from hpkv
        while hpkv_status(env)["clients"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hpkv_status(env)["clients"] == []
        stop = hpkv(env, "stop")
        assert stop.returncode == 0 and f"server {server_pid} stopped" in stop.stdout, (
            stop.stdout,
            stop.stderr,
        )
        assert os.listdir(env["HPKV_SHARE_MEM_FILE_PATH"]) == ["server.log"]
    finally:
        srv.stop()
