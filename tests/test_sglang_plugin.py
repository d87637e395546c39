"""``--enable-ct-hpkv``: how hpkv's SGLang plugin turns CT-HPKV's flag into HiCache's arguments.

The argument rewriting is tested directly (milliseconds, no SGLang needed); one test parses
real SGLang 0.5.23 command lines in ``.venv-sglang`` to prove the plugin is loaded and applied,
and one starts a real SGLang server with CT-HPKV's published command line (``sglang serve
--model-path --enable-ct-hpkv MODEL …``, the flag between the option and its value).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from hpkv.connectors.sglang import BACKEND_EXTRA_CONFIG
from hpkv.connectors.sglang.plugin import hicache_settings, published_order
from hpkv.testing.server import private_env
from hpkv.testing.sglang_server import SHIMS_DIR, SglangServer, sglang_python
from hpkv.testing.vllm_server import hpkv_status


def test_flag_alone_selects_hpkv_with_the_hpkv_threshold() -> None:
    backend, extra = hicache_settings(None, None, token_threshold=1204)
    assert backend == "dynamic"
    assert json.loads(extra) == {**BACKEND_EXTRA_CONFIG, "prefetch_threshold": 1204}


def test_auto_threshold_leaves_sglangs_own_prefetch_threshold() -> None:
    _, extra = hicache_settings(None, None, token_threshold=None)
    assert "prefetch_threshold" not in json.loads(extra)


def test_user_extra_config_is_merged_and_wins() -> None:
    _, extra = hicache_settings("dynamic", '{"prefetch_threshold": 32, "prefetch_timeout_base": 2.5}', 1204)
    cfg = json.loads(extra)
    assert cfg["prefetch_threshold"] == 32 and cfg["prefetch_timeout_base"] == 2.5
    assert cfg["class_name"] == "HpkvHiCacheStorage" and cfg["allocator"] == "shm"


def test_extra_config_from_a_json_file(tmp_path: Path) -> None:
    f = tmp_path / "hicache.json"
    f.write_text('{"prefetch_policy_note": "x"}')
    _, extra = hicache_settings(None, f"@{f}", 64)
    assert json.loads(extra)["prefetch_policy_note"] == "x"


def test_another_storage_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'mooncake'"):
        hicache_settings("mooncake", None, 64)


def test_bad_extra_config_is_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="not valid JSON.*oops"):
        hicache_settings(None, "{oops", 64)
    with pytest.raises(ValueError, match="JSON object"):
        hicache_settings(None, "[1]", 64)
    with pytest.raises(ValueError, match="@cfg.yaml"):
        hicache_settings(None, "@cfg.yaml", 64)


#: CT-HPKV's published SGLang command line, the flag between ``--model-path`` and its value.
PUBLISHED = ["--model-path", "--enable-ct-hpkv", "/m", "--host", "127.0.0.1", "--page-size", "64"]


def test_published_order_puts_the_model_path_back_after_its_option() -> None:
    assert published_order(PUBLISHED) == [
        "--model-path", "/m", "--enable-ct-hpkv", "--host", "127.0.0.1", "--page-size", "64"
    ]  # fmt: skip
    assert published_order(["--model", "--enable-ct-hpkv", "/m"]) == ["--model", "/m", "--enable-ct-hpkv"]


def test_published_order_leaves_every_other_command_line_alone() -> None:
    for argv in (
        ["--model-path", "/m", "--enable-ct-hpkv"],
        ["--enable-ct-hpkv", "--model-path", "/m"],
        ["--model-path", "--enable-ct-hpkv", "--port", "1"],  # no value follows: SGLang's own error
        ["--model-path", "--enable-ct-hpkv"],
    ):
        assert published_order(argv) == argv


@pytest.mark.sglang
@pytest.mark.skipif(sglang_python() is None, reason="no .venv-sglang (scripts/setup-sglang.sh)")
def test_sglang_parses_enable_ct_hpkv_through_the_plugin(tmp_path: Path) -> None:
    """Both orders: the flag after the model path, and CT-HPKV's (between the option and its value)."""
    code = textwrap.dedent("""
        import json, sys
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args
        load_plugins()
        for argv in (["--model-path", "/nonexistent", "--enable-ct-hpkv"], json.loads(sys.argv[1])):
            a = prepare_server_args(argv + ["--device", "cpu"])
            print(json.dumps({"hicache": a.enable_hierarchical_cache, "backend": a.hicache_storage_backend,
                              "extra": json.loads(a.hicache_storage_backend_extra_config),
                              "model": a.model_path, "page": a.page_size}))
    """)
    (tmp_path / "empty.ini").write_text("")
    env = {
        # This checkout's hpkv, also where .venv-sglang's editable hpkv is another checkout's.
        "PYTHONPATH": f"{SHIMS_DIR}:{Path(__file__).resolve().parents[1]}",
        "SGLANG_USE_CPU_ENGINE": "1",
        "VLLM_HPKV_TOKEN_THRESHOLD": "96",
        "HPKV_CONFIG_FILE_PATH": str(tmp_path / "empty.ini"),
        "PATH": "/usr/bin:/bin",
    }
    py = sglang_python()
    assert py is not None
    out = subprocess.run(
        [py, "-W", "ignore", "-c", code, json.dumps(PUBLISHED)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plain, published = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    hpkv = {
        "hicache": True,
        "backend": "dynamic",
        "extra": {**BACKEND_EXTRA_CONFIG, "prefetch_threshold": 96},
    }
    assert plain == {**hpkv, "model": "/nonexistent", "page": plain["page"]}
    assert published == {**hpkv, "model": "/m", "page": 64}
    assert "hpkv: read CT-HPKV's '--model-path --enable-ct-hpkv MODEL'" in out.stderr


class PublishedSglangServe(SglangServer):
    """CT-HPKV's SGLang command line, the model path and the loopback address aside, then what
    SGLang needs on this CPU-only machine (:meth:`SglangServer.machine_args`)."""

    def command(self) -> list[str]:
        sglang = str(Path(self.python).with_name("sglang"))
        published = [
            sglang, "serve", "--model-path", "--enable-ct-hpkv", self.model,
            "--host", self.host, "--port", str(self.port), "--page-size", "64",
        ]  # fmt: skip
        return published + self.machine_args()


@pytest.mark.sglang
@pytest.mark.timeout(900)
@pytest.mark.skipif(sglang_python() is None, reason="no .venv-sglang (scripts/setup-sglang.sh)")
def test_ct_hpkv_sglang_command_line_stores_pages_in_hpkv(tiny_model: str, tmp_path: Path) -> None:
    storage = tempfile.mkdtemp(prefix="hpkv-sglang-cli-", dir="/var/tmp")
    env = private_env(pool_size="256m", storage=storage, VLLM_HPKV_TOKEN_THRESHOLD="64")
    srv = PublishedSglangServe(tiny_model, env=env, log_path=tmp_path / "sglang.log")
    try:
        srv.start().wait_ready(timeout=600)
        log = srv.log_tail(100_000)
        assert "hpkv: read CT-HPKV's '--model-path --enable-ct-hpkv MODEL'" in log
        out = srv.generate(" ".join("ABCDEFGHIJ"[(i * 3) % 10] for i in range(200)), max_new_tokens=4)
        assert out["meta_info"]["prompt_tokens"] == 200
        # SGLang backs its pages up to L3 (hpkv) on its own thread after the request.
        deadline = time.monotonic() + 60
        while True:
            rows = [
                ns for ns in (hpkv_status(env) or {}).get("namespaces", []) if "ps64" in ns.get("name", "")
            ]
            if rows and rows[0].get("commits", 0) >= 3:  # 200 tokens: 3 full pages of 64
                break
            assert time.monotonic() < deadline, f"hpkv stored no 64-token pages: {rows}\n{srv.log_tail(60)}"
            time.sleep(0.5)
    except BaseException:
        print(srv.log_tail(150))
        raise
    finally:
        srv.stop()
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
        os.unlink(env["HPKV_CONFIG_FILE_PATH"])
