"""``--enable-ct-hpkv``: how hpkv's SGLang plugin turns CT-HPKV's flag into HiCache's arguments.

The argument rewriting is tested directly (milliseconds, no SGLang needed); one test parses a
real SGLang 0.5.23 command line in ``.venv-sglang`` to prove the plugin is loaded and applied.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from hpkv.connectors.sglang import BACKEND_EXTRA_CONFIG
from hpkv.connectors.sglang.plugin import hicache_settings
from hpkv.testing.sglang_server import SHIMS_DIR, sglang_python


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


@pytest.mark.sglang
@pytest.mark.skipif(sglang_python() is None, reason="no .venv-sglang (scripts/setup-sglang.sh)")
def test_sglang_parses_enable_ct_hpkv_through_the_plugin(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import json, sys
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args
        load_plugins()
        a = prepare_server_args(["--model-path", "/nonexistent", "--enable-ct-hpkv", "--device", "cpu"])
        print(json.dumps({"hicache": a.enable_hierarchical_cache, "backend": a.hicache_storage_backend,
                          "extra": json.loads(a.hicache_storage_backend_extra_config)}))
    """)
    (tmp_path / "empty.ini").write_text("")
    env = {
        "PYTHONPATH": str(SHIMS_DIR),
        "SGLANG_USE_CPU_ENGINE": "1",
        "VLLM_HPKV_TOKEN_THRESHOLD": "96",
        "HPKV_CONFIG_FILE_PATH": str(tmp_path / "empty.ini"),
        "PATH": "/usr/bin:/bin",
    }
    py = sglang_python()
    assert py is not None
    out = subprocess.run(
        [py, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "hicache": True,
        "backend": "dynamic",
        "extra": {**BACKEND_EXTRA_CONFIG, "prefetch_threshold": 96},
    }
