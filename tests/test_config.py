"""Configuration: lookup order, ini forms, parsing and the runtime checks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpkv import config as C
from hpkv.common import checks
from hpkv.common.checks import check_runtime
from hpkv.config import ConfigError, load_config, parse_size


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def env(tmp_path):
    """An environment that points at an (empty) config file inside tmp_path."""
    (tmp_path / "config.ini").write_text("")
    return {"HPKV_CONFIG_FILE_PATH": str(tmp_path / "config.ini"), "HOME": str(tmp_path)}


# One representative non-default value per kind of key: (key, file value, env value, typed file value)
KINDS = [
    ("HPKV_KV_STORAGE_PATH", "/data/a", "/data/b", "/data/a"),
    ("HPKV_KV_MEM_POOL_SIZE", "512m", "2g", 512 << 20),
    ("HPKV_SHARE_MEM_FILE_PATH", "/dev/shm/x", "/dev/shm/y", "/dev/shm/x"),
    ("VLLM_HPKV_TOKEN_THRESHOLD", "256", "512", 256),
    ("VLLM_ENABLE_HPKV", "0", "1", False),
    ("HPKV_SERVER_IDLE_EXIT", "1.5", "9", 1.5),
    ("HPKV_STORAGE_MIN_FREE", "7%", "9", 7.0),
    ("HPKV_LOG_LEVEL", "debug", "error", "DEBUG"),
    ("HPKV_METRICS_HOST", "::1", "localhost", "::1"),
    ("HPKV_STORAGE_ADMIT", "reuse:2", "always", 2),
]


@pytest.mark.parametrize("key,file_value,env_value,typed", KINDS, ids=[k[0] for k in KINDS])
def test_file_beats_env_beats_default(tmp_path, env, key, file_value, env_value, typed):
    default = load_config(env={"HOME": str(tmp_path)})
    assert default.source(key).kind == "default"

    from_env = load_config(env={**env, key: env_value})
    assert from_env.source(key).kind == "env"
    assert from_env.settings[key].raw == env_value

    write(tmp_path / "config.ini", f"# a comment\n{key}={file_value}\n")
    from_file = load_config(env={**env, key: env_value})
    assert from_file[key] == typed
    assert str(from_file.source(key)) == f"{tmp_path / 'config.ini'}:2"


def test_every_key_has_a_default_that_parses():
    cfg = load_config(env={"HOME": "/nonexistent-home"})
    assert set(cfg.settings) == set(C.KEYS)
    assert cfg.pool_size == 8 << 30
    assert cfg["VLLM_HPKV_TOKEN_THRESHOLD"] == 1204
    assert cfg["VLLM_ENABLE_HPKV"] is True
    assert cfg.storage_path == "/nonexistent-home/.cache/hpkv/storage"
    assert cfg.pool_dir == "/dev/shm/hpkv"


def test_default_config_file_is_in_home(tmp_path):
    (tmp_path / ".config" / "hpkv").mkdir(parents=True)
    write(tmp_path / ".config" / "hpkv" / "config.ini", "HPKV_KV_MEM_POOL_SIZE=1g\n")
    cfg = load_config(env={"HOME": str(tmp_path)})
    assert cfg.pool_size == 1 << 30
    assert cfg.source("HPKV_KV_MEM_POOL_SIZE").path == str(tmp_path / ".config/hpkv/config.ini")


def test_bare_lines_and_section_both_work(tmp_path, env):
    write(
        tmp_path / "config.ini",
        "HPKV_KV_MEM_POOL_SIZE = 1g\n; comment\n[hpkv]\nVLLM_HPKV_TOKEN_THRESHOLD=64\n",
    )
    cfg = load_config(env=env)
    assert cfg.pool_size == 1 << 30
    assert cfg["VLLM_HPKV_TOKEN_THRESHOLD"] == 64
    assert cfg.source("VLLM_HPKV_TOKEN_THRESHOLD").line == 4


def test_other_sections_are_ignored_with_a_warning(tmp_path, env):
    write(tmp_path / "config.ini", "[other]\nHPKV_KV_MEM_POOL_SIZE=1g\n")
    cfg = load_config(env=env)
    assert cfg.source("HPKV_KV_MEM_POOL_SIZE").kind == "default"
    assert any("[other]" in w for w in cfg.warnings)


def test_inline_comments_quotes_and_export(tmp_path, env):
    write(
        tmp_path / "config.ini",
        'export HPKV_KV_STORAGE_PATH="/data/run#1"   # where files go\nHPKV_KV_MEM_POOL_SIZE=2g ; two gigs\n',
    )
    cfg = load_config(env=env)
    assert cfg.storage_path == "/data/run#1"
    assert cfg.pool_size == 2 << 30


def test_paths_expand_tilde_and_vars(tmp_path, env):
    write(
        tmp_path / "config.ini", "HPKV_KV_STORAGE_PATH=${MYDATA}/kv/$RUN\nHPKV_SHARE_MEM_FILE_PATH=~/pool\n"
    )
    cfg = load_config(env={**env, "HOME": "/home/op", "MYDATA": "/mnt/fast", "RUN": "r1"})
    assert cfg.storage_path == "/mnt/fast/kv/r1"
    assert cfg.pool_dir == "/home/op/pool"


def test_empty_storage_path_disables_storage(tmp_path, env):
    write(tmp_path / "config.ini", "HPKV_KV_STORAGE_PATH=\n")
    assert load_config(env=env).storage_path is None


BAD = [
    ("HPKV_KV_MEM_POOL_SIZE", "8x", "size"),
    ("HPKV_KV_MEM_POOL_SIZE", "-1g", "size"),
    ("HPKV_KV_MEM_POOL_SIZE", "1k", "at least 1m"),
    ("VLLM_HPKV_TOKEN_THRESHOLD", "many", "integer"),
    ("VLLM_HPKV_TOKEN_THRESHOLD", "-5", "integer"),
    ("VLLM_ENABLE_HPKV", "maybe", "true/false"),
    ("HPKV_NUM_IO_WORKERS", "0", "1..64"),
    ("HPKV_DRAM_EVICTION", "arc", "lru or s3fifo"),
    ("HPKV_STORAGE_MIN_FREE", "120%", "percentage"),
    ("HPKV_LOG_LEVEL", "loud", "DEBUG"),
    ("HPKV_STORAGE_ADMIT", "reuse:0", "reuse:N"),
    ("HPKV_STORAGE_ADMIT", "sometimes", "reuse:N"),
    ("HPKV_SHARE_MEM_FILE_PATH", "", "directory path"),
    ("HPKV_KV_STORAGE_PATH", "$HPKV_SURELY_UNSET_VAR/kv", "HPKV_SURELY_UNSET_VAR"),
]


@pytest.mark.parametrize("key,value,form", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_bad_value_from_file_names_key_value_line_and_form(tmp_path, env, key, value, form):
    write(tmp_path / "config.ini", f"\n{key}={value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    msg = str(err.value)
    assert key in msg and repr(value) in msg
    assert f"{tmp_path / 'config.ini'}:2" in msg
    assert form in msg


@pytest.mark.parametrize("key,value,form", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_bad_value_from_env_says_environment(env, key, value, form):
    with pytest.raises(ConfigError) as err:
        load_config(env={**env, key: value})
    msg = str(err.value)
    assert key in msg and repr(value) in msg and "(from environment)" in msg and form in msg


def test_unparseable_line_names_file_and_line(tmp_path, env):
    write(tmp_path / "config.ini", "HPKV_KV_MEM_POOL_SIZE=1g\njust some words\n")
    with pytest.raises(ConfigError, match=r"config\.ini:2: cannot parse 'just some words'"):
        load_config(env=env)


def test_missing_explicit_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(env={"HPKV_CONFIG_FILE_PATH": str(tmp_path / "missing.ini")})


def test_handed_over_configuration_keeps_every_value_and_source(tmp_path):
    cfg_file = write(tmp_path / "config.ini", "\n# a comment\nHPKV_KV_MEM_POOL_SIZE=512m\n")
    parent_env = {"HPKV_CONFIG_FILE_PATH": cfg_file, "HOME": str(tmp_path), "HPKV_LOG_LEVEL": "debug"}
    parent = load_config(env=parent_env)
    # The child sees other variables and no config file at all: the hand-over alone decides.
    child_env = {
        "HOME": str(tmp_path),
        "HPKV_LOG_LEVEL": "error",
        "HPKV_CONFIG_FILE_PATH": "/nonexistent",
        **parent.to_env(),
    }
    child = load_config(env=child_env)
    assert {k: (s.value, str(s.source)) for k, s in child.settings.items()} == {
        k: (s.value, str(s.source)) for k, s in parent.settings.items()
    }
    assert str(child.source("HPKV_KV_MEM_POOL_SIZE")) == f"{cfg_file}:3"
    assert str(child.source("HPKV_LOG_LEVEL")) == "environment"
    assert str(child.source("HPKV_KV_STORAGE_PATH")) == "default", "a default stays a default"
    assert (child.config_file, child.config_file_found) == (cfg_file, True)


def test_without_a_config_file_the_hand_over_names_no_file_and_is_no_error(tmp_path):
    parent = load_config(env={"HOME": str(tmp_path)})  # ~/.config/hpkv/config.ini does not exist
    assert not parent.config_file_found
    assert C.CONFIG_FILE_ENV not in parent.to_env()
    child = load_config(env={"HOME": str(tmp_path), **parent.to_env()})
    assert not child.config_file_found and all(str(s.source) == "default" for s in child.settings.values())


def test_a_handed_over_bad_value_names_key_value_and_source(tmp_path):
    bad = json.dumps(
        {
            "config_file": "x",
            "found": False,
            "settings": {"HPKV_KV_MEM_POOL_SIZE": {"raw": "lots", "source": ["env", None, None]}},
        }
    )
    with pytest.raises(ConfigError, match=r"HPKV_KV_MEM_POOL_SIZE='lots' \(from environment\) is invalid"):
        load_config(env={C.RESOLVED_ENV: bad, "HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="not a configuration hpkv handed over"):
        load_config(env={C.RESOLVED_ENV: "{", "HOME": str(tmp_path)})


def test_unknown_key_warns_with_nearest_known_key(tmp_path, env):
    write(tmp_path / "config.ini", "HPKV_KV_MEM_POOL_SIZ=1g\nHPKV_TOTALLY_NEW=1\n")
    cfg = load_config(env=env)
    assert any(
        ":1: unknown key HPKV_KV_MEM_POOL_SIZ; did you mean HPKV_KV_MEM_POOL_SIZE?" in w for w in cfg.warnings
    )
    assert any("HPKV_TOTALLY_NEW" in w and "did you mean" not in w for w in cfg.warnings)


# ---------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    "text,expected",
    [
        ("4096", 4096),
        ("512m", 512 << 20),
        ("8g", 8 << 30),
        ("16G", 16 << 30),
        ("1.5GiB", 3 << 29),
        ("2KB", 2048),
        ("1kib", 1024),
        (" 3 M ", 3 << 20),
        ("0", 0),
        ("1t", 1 << 40),
        ("10b", 10),
    ],
)
def test_parse_size_examples(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "g", "1.2.3g", "1x", "-1", "1 g b", "ib", "1ib", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@given(
    whole=st.integers(min_value=0, max_value=10**6),
    frac=st.one_of(st.none(), st.integers(min_value=0, max_value=999)),
    unit=st.sampled_from(sorted(UNITS)),
    suffix=st.sampled_from(["", "b", "ib"]),
    upper=st.booleans(),
)
def test_parse_size_matches_reference(whole, frac, unit, suffix, upper):
    if suffix == "ib" and not unit:
        suffix = ""
    number = f"{whole}" if frac is None else f"{whole}.{frac:03d}"
    text = number + unit + suffix
    if upper:
        text = text.upper()
    reference = int(Decimal(number) * UNITS[unit])  # exact decimal arithmetic, rounds toward zero
    assert parse_size(text) == reference


# ---------------------------------------------------------------- runtime checks
def cfg_with(env, tmp_path, **values):
    write(tmp_path / "config.ini", "".join(f"{k}={v}\n" for k, v in values.items()))
    return load_config(env=env)


def test_pool_on_tmpfs_passes_and_on_disk_warns(tmp_path, env):
    shm = f"/dev/shm/hpkv-test-{os.getpid()}"
    try:
        cfg = cfg_with(
            env,
            tmp_path,
            HPKV_SHARE_MEM_FILE_PATH=shm,
            HPKV_KV_MEM_POOL_SIZE="1m",
            HPKV_KV_STORAGE_PATH=str(tmp_path / "storage"),
        )
        assert check_runtime(cfg) == []
        assert stat.S_IMODE(os.stat(shm).st_mode) == 0o700
    finally:
        os.rmdir(shm)

    assert checks.filesystem_type(str(tmp_path)) not in checks.RAM_FILESYSTEMS
    cfg = cfg_with(
        env,
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "pool"),
        HPKV_KV_MEM_POOL_SIZE="1m",
        HPKV_KV_STORAGE_PATH="",
    )
    warnings = check_runtime(cfg)
    assert len(warnings) == 1
    assert "not tmpfs or ramfs" in warnings[0] and str(tmp_path / "pool") in warnings[0]
    assert "evict" in warnings[0]


def test_ramfs_counts_as_memory(monkeypatch, tmp_path, env):
    monkeypatch.setattr(checks, "filesystem_type", lambda path: "ramfs")
    cfg = cfg_with(
        env,
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "pool"),
        HPKV_KV_MEM_POOL_SIZE="1m",
        HPKV_KV_STORAGE_PATH="",
    )
    assert check_runtime(cfg) == []


def test_storage_directory_is_created(tmp_path, env):
    storage = tmp_path / "a" / "b" / "storage"
    cfg = cfg_with(
        env,
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "pool"),
        HPKV_KV_MEM_POOL_SIZE="1m",
        HPKV_KV_STORAGE_PATH=str(storage),
    )
    check_runtime(cfg)
    assert storage.is_dir()


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot write into, even as root (immutable attribute)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.getuid() == 0:
        subprocess.run(["chattr", "+i", str(d)], check=True)
        yield d
        subprocess.run(["chattr", "-i", str(d)], check=True)
    else:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)


def test_unwritable_storage_directory_names_path_and_problem(tmp_path, env, unwritable_dir):
    cfg = cfg_with(
        env,
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "pool"),
        HPKV_KV_MEM_POOL_SIZE="1m",
        HPKV_KV_STORAGE_PATH=str(unwritable_dir),
    )
    with pytest.raises(ConfigError) as err:
        check_runtime(cfg)
    msg = str(err.value)
    assert f"HPKV_KV_STORAGE_PATH={unwritable_dir} (from {tmp_path}/config.ini:3)" in msg
    assert "is not writable by uid" in msg
    assert ("Operation not permitted" in msg) or ("Permission denied" in msg)
    assert "fix its permissions" in msg


def test_storage_path_that_is_a_file(tmp_path, env):
    f = tmp_path / "file"
    f.write_text("x")
    cfg = cfg_with(
        env,
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "pool"),
        HPKV_KV_MEM_POOL_SIZE="1m",
        HPKV_KV_STORAGE_PATH=str(f),
    )
    with pytest.raises(ConfigError, match="cannot create the directory"):
        check_runtime(cfg)


def test_pool_larger_than_free_space_is_an_error_with_both_numbers(tmp_path, env):
    cfg = cfg_with(
        env,
        tmp_path,
        HPKV_SHARE_MEM_FILE_PATH="/dev/shm/hpkv-too-big",
        HPKV_KV_MEM_POOL_SIZE="1t",
        HPKV_KV_STORAGE_PATH="",
    )
    free = checks.free_bytes("/dev/shm")
    try:
        with pytest.raises(ConfigError) as err:
            check_runtime(cfg)
    finally:
        if os.path.isdir("/dev/shm/hpkv-too-big"):
            os.rmdir("/dev/shm/hpkv-too-big")
    msg = str(err.value)
    assert "HPKV_KV_MEM_POOL_SIZE=1t" in msg and str(1 << 40) in msg
    assert "free" in msg and str(free)[:4] in msg


# ---------------------------------------------------------------- CLI
def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hpkv", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_cli_config_json_has_value_and_source_per_key(tmp_path, env):
    write(tmp_path / "config.ini", "\nHPKV_KV_MEM_POOL_SIZE=1g\n")
    out = run_cli("config", "--json", env={**env, "VLLM_HPKV_TOKEN_THRESHOLD": "77"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == set(C.KEYS)
    assert data["HPKV_KV_MEM_POOL_SIZE"] == {
        "value": 1 << 30,
        "source": f"{tmp_path}/config.ini:2",
        "raw": "1g",
    }
    assert data["VLLM_HPKV_TOKEN_THRESHOLD"]["value"] == 77
    assert data["VLLM_HPKV_TOKEN_THRESHOLD"]["source"] == "environment"
    assert data["HPKV_NUM_IO_WORKERS"]["source"] == "default"


def test_cli_config_table(tmp_path, env):
    write(tmp_path / "config.ini", "HPKV_KV_MEM_POOL_SIZE=1g\n")
    out = run_cli("config", env=env)
    assert out.returncode == 0
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("HPKV_KV_MEM_POOL_SIZE"))
    assert "1g (1.0 GiB)" in line and f"{tmp_path}/config.ini:1" in line


def test_cli_config_markdown_prints_the_documented_table_and_rewrites_a_page(tmp_path, env):
    out = run_cli("config", "--markdown", env=env)
    assert out.returncode == 0 and out.stdout == C.markdown_table()
    page = tmp_path / "configuration.md"
    begin, end = C.DOC_TABLE_BEGIN, C.DOC_TABLE_END
    write(page, f"# Configuration\n\n{begin}\n| stale |\n{end}\nafter\n")
    out = run_cli("config", "--markdown", str(page), env=env)
    assert out.returncode == 0, out.stderr
    assert page.read_text() == f"# Configuration\n\n{begin}\n{C.markdown_table()}{end}\nafter\n"
    write(page, "# no markers\n")
    out = run_cli("config", "--markdown", str(page), env=env)
    assert out.returncode == 1 and "markers" in out.stderr and page.read_text() == "# no markers\n"


def test_cli_config_error_exits_1_with_message(env):
    out = run_cli("config", env={**env, "HPKV_KV_MEM_POOL_SIZE": "lots"})
    assert out.returncode == 1
    assert "HPKV_KV_MEM_POOL_SIZE='lots' (from environment)" in out.stderr


def test_cli_version_and_usage_errors():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("hpkv ")
    for bad in (["frobnicate"], ["config", "--bogus"], []):
        out = run_cli(*bad)
        assert out.returncode == 2, bad
        assert "usage: hpkv" in out.stderr


def test_cli_output_into_a_closed_pipe_ends_quietly(env):
    """`hpkv config | head -1`: the reader is gone before hpkv writes; no traceback."""
    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hpkv", "config"],
            stdout=w,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
            timeout=60,
        )
    finally:
        os.close(w)
    assert out.returncode == 141 and out.stderr == b"", out.stderr.decode()


def test_the_token_threshold_takes_auto_and_names_the_form_when_wrong(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert load_config(env={**env, "VLLM_HPKV_TOKEN_THRESHOLD": "auto"})["VLLM_HPKV_TOKEN_THRESHOLD"] is None
    assert (
        load_config(env={**env, "VLLM_HPKV_TOKEN_THRESHOLD": " AUTO "})["VLLM_HPKV_TOKEN_THRESHOLD"] is None
    )
    with pytest.raises(ConfigError, match=r"VLLM_HPKV_TOKEN_THRESHOLD.*'fast'.*an integer >= 0, or auto"):
        load_config(env={**env, "VLLM_HPKV_TOKEN_THRESHOLD": "fast"})


def test_the_tier_order_names_each_tier_below_the_pool_once() -> None:
    assert load_config({})["HPKV_TIER_ORDER"] == ("files", "remote")
    assert load_config({"HPKV_TIER_ORDER": " Remote , files"})["HPKV_TIER_ORDER"] == ("remote", "files")
    for bad in ("files", "files,files", "files,remote,dram", "disk,remote", ""):
        with pytest.raises(ConfigError) as err:
            load_config({"HPKV_TIER_ORDER": bad})
        msg = str(err.value)
        assert f"HPKV_TIER_ORDER={bad!r}" in msg and "files,remote or remote,files" in msg, msg
    assert load_config({"HPKV_REMOTE_WRITE_POLICY": "evict"})["HPKV_REMOTE_WRITE_POLICY"] == "evict"
    with pytest.raises(ConfigError, match=r"HPKV_REMOTE_WRITE_POLICY='lazy'.*not one of commit, evict"):
        load_config({"HPKV_REMOTE_WRITE_POLICY": "lazy"})
